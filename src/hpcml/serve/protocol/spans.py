"""OpenTelemetry spans for each inference request (`hpcml serve --tracing`).

One trace per request: a root span `hpcml.infer` (model, version, protocol, status code) with
children `receive` (reading and parsing the body), `queue` (waiting in the dynamic batcher),
`compute` (the batched forward pass it shared, with the batch's number and size) and `respond`
(encoding the answer). The batcher times queue and compute with `time.perf_counter`; the spans
are written when the request ends, from those readings placed on the wall clock through one
anchor all requests share, so tracing adds nothing to the batcher's loop and the requests of a
batch show the same compute span. A request that fails ends its root span with an error status
and the children it reached.
"""

from __future__ import annotations

import time
from typing import Any

from hpcml.serve.runtime.batcher import InferResult

_ANCHOR: tuple[int, float] = (time.time_ns(), time.perf_counter())
ANCHOR_EVERY_S = 60.0


def _anchor() -> tuple[int, float]:
    """(wall-clock ns, perf_counter) read together, shared by all requests and re-read every
    minute: requests of one batch convert its perf_counter times to the same wall-clock times
    (each request reading its own pair would shift them by the microseconds between the two
    reads), and the wall clock's corrections reach the spans within a minute."""
    global _ANCHOR
    if time.perf_counter() - _ANCHOR[1] > ANCHOR_EVERY_S:
        _ANCHOR = (time.time_ns(), time.perf_counter())
    return _ANCHOR


class RequestTrace:
    """The timings of one request, turned into spans by `finish`."""

    def __init__(self, tracer: Any, protocol: str, model: str, version: str | None) -> None:
        self.tracer = tracer
        self.anchor = _anchor()
        self.perf0 = time.perf_counter()
        self.wall0 = self._ns(self.perf0)
        self.attributes: dict[str, Any] = {
            "hpcml.protocol": protocol,
            "hpcml.model": model,
            **({"hpcml.version": version} if version else {}),
        }
        self.parsed_at: float | None = None
        self.result: InferResult | None = None
        self.answered_at: float | None = None

    def _ns(self, perf: float) -> int:
        wall, at = self.anchor
        return wall + round((perf - at) * 1e9)

    def parsed(self) -> None:
        self.parsed_at = time.perf_counter()

    def computed(self, result: InferResult, version: str) -> None:
        self.result = result
        self.answered_at = time.perf_counter()
        self.attributes["hpcml.version"] = version

    def finish(self, code: str, error: str | None = None) -> None:
        """Write the spans; `code` is the HTTP status or gRPC code sent."""
        from opentelemetry import trace
        from opentelemetry.trace import Status, StatusCode

        end = time.perf_counter()
        root = self.tracer.start_span(
            "hpcml.infer",
            start_time=self.wall0,
            attributes={**self.attributes, "hpcml.code": code},
        )
        if error is not None:
            root.set_status(Status(StatusCode.ERROR, error))
        ctx = trace.set_span_in_context(root)

        def child(name: str, start: float, stop: float, **attrs: Any) -> None:
            span = self.tracer.start_span(
                name, context=ctx, start_time=self._ns(start), attributes=attrs or None
            )
            span.end(end_time=self._ns(stop))

        if self.parsed_at is not None:
            child("receive", self.perf0, self.parsed_at)
        r = self.result
        if r is not None and self.answered_at is not None:
            child("queue", r.started - r.queue_s, r.started)
            attrs = {"hpcml.batch": r.batch, "hpcml.batch_size": r.batch_size}
            child("compute", r.started, r.started + r.compute_s, **attrs)
            child("respond", self.answered_at, end)
        root.end(end_time=self._ns(end))
