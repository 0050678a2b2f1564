"""The load tester reports everything: timeouts and errors in the latency percentiles, requests
it could not send kept out of `sent` and `achieved_rate`, and several client processes merged."""

from __future__ import annotations

import asyncio
import random

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from hpcml.serve.loadtest import loadtest
from hpcml.serve.testing import running_server


def _app(slow_every: int, slow_s: float) -> Starlette:
    """Every `slow_every`-th request waits `slow_s` (without blocking the loop), others answer
    at once."""
    count = {"n": 0}

    async def infer(request: Request) -> JSONResponse:
        await request.body()
        count["n"] += 1
        if slow_every and count["n"] % slow_every == 0:
            await asyncio.sleep(slow_s)
        return JSONResponse({"model_name": "m", "outputs": []})

    return Starlette(routes=[Route("/v2/models/m/infer", infer, methods=["POST"])])


def test_timeouts_count_in_the_all_requests_percentiles() -> None:
    with running_server(_app(2, 2.0)) as base:
        r = loadtest(
            base_url=base, model="m", concurrency=2, duration_s=1.0, payload=b"{}", timeout_s=0.2
        )
    timeouts = r.errors.get("client_timeout", 0)
    assert timeouts >= 1 and r.ok >= 1
    assert r.latency_all_ms["count"] == r.sent == r.ok + sum(r.errors.values())
    assert r.error_latency_ms["count"] == sum(r.errors.values())
    # A timed-out request is recorded when the client gave up, at >= its 0.2 s timeout; with
    # more than 1% of requests timing out, the p99 of all requests is one of them.
    assert r.error_latency_ms["min"] >= 200
    assert timeouts / r.sent > 0.01 and r.latency_all_ms["p99"] >= 200


def test_requests_not_sent_are_not_counted_as_sent() -> None:
    with running_server(_app(1, 1.0)) as base:  # every request takes 1 s
        r = loadtest(
            base_url=base, model="m", rate=100, duration_s=0.5, payload=b"{}", max_inflight=2
        )
    # Two requests go out and hold the in-flight limit for the whole 0.5 s run; every later
    # arrival (seeded Poisson, 100/s) is due while they are outstanding.
    assert r.sent == 2 and r.ok == 2
    assert r.achieved_rate == 2 / 0.5
    assert r.not_sent >= 10 and r.latency_all_ms["count"] == 2


def _arrivals(rate: float, duration_s: float, seed: int) -> int:
    rng, t, n = random.Random(seed), 0.0, 0
    while (t := t + rng.expovariate(rate)) < duration_s:
        n += 1
    return n


def test_two_client_processes_split_the_rate_and_merge_their_histograms() -> None:
    with running_server(_app(0, 0.0)) as base:
        r = loadtest(processes=2, base_url=base, model="m", rate=120, duration_s=1.0, payload=b"{}")
    assert r.processes == 2
    # Each process draws its own seeded Poisson arrivals at half the rate.
    assert r.sent == _arrivals(60, 1.0, 0) + _arrivals(60, 1.0, 1)
    assert r.ok == r.sent and r.latency_ms["count"] == r.sent
    assert r.achieved_rate == r.sent / 1.0
