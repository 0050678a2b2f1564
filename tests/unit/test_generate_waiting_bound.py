"""`generation.max_waiting` holds under a burst: a request admitted by `GenerationService.admit`
counts as waiting from that moment, not only once its generation has started.

The endpoints admit a request, then start its generation a loop iteration or more later (a
streamed response's body runs in a task of its own, a non-streamed request in another); on main
every request of a burst that arrived in between saw the others uncounted, so all of them passed
a bound of 1. No engine process is started here: `admit` and `waiting` read only the service's
own books, and a closing service ends `generate` at once (after it has counted the start).
"""

from __future__ import annotations

import asyncio

import pytest

import hpcml.serve.generate.service as service_module
from hpcml.serve.generate.engine import EngineConfig
from hpcml.serve.generate.engine_process import EngineSpec
from hpcml.serve.generate.sampling import ByteTokenizer, SamplingParams
from hpcml.serve.generate.service import GenerationService, QueueFull


def make_service(max_waiting: int) -> GenerationService:
    spec = EngineSpec("m", "unused", EngineConfig(kv_cache_blocks=8), ByteTokenizer())
    return GenerationService(spec, max_seq_len=64, max_waiting=max_waiting)


def start_generation(service: GenerationService) -> str | None:
    """Run one `generate` of a closing service to its end; the abort's reason."""

    async def first() -> str | None:
        async for ev in service.generate([1, 2], SamplingParams(max_tokens=1)):
            return ev.reason
        return None

    return asyncio.run(first())


def test_a_burst_admitted_before_any_generation_starts_cannot_pass_the_bound() -> None:
    service = make_service(max_waiting=2)
    service.admit(1)
    service.admit(1)
    assert service.waiting == 2
    with pytest.raises(QueueFull, match="2 sequences already wait"):
        service.admit(1)


def test_an_admission_stops_counting_when_its_generation_starts_or_after_the_hold() -> None:
    service = make_service(max_waiting=3)
    service.admit(2)  # one request of n = 2
    service._closing = True  # generate ends at once, as in a shutdown
    assert "shutting down" in (start_generation(service) or "")
    assert service.waiting == 1
    start_generation(service)
    assert service.waiting == 0
    service._closing = False
    service.admit(3)
    with pytest.raises(QueueFull):
        service.admit(1)


def test_an_admission_whose_generation_never_starts_expires(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A client gone before its stream began never reaches `generate`: its admission must not
    hold the queue forever."""
    service = make_service(max_waiting=1)
    service.admit(1)
    monkeypatch.setattr(service_module, "ADMISSION_HOLD_S", -1.0)  # every admission is old
    assert service.waiting == 0
    service.admit(1)
