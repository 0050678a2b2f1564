"""OpenTelemetry spans for each inference request (`hpcml serve --tracing`).

One trace per request: a root span `hpcml.infer` of kind SERVER (model, version, protocol,
status code), the child of the client's span when the request carries a W3C `traceparent`
(HTTP header or gRPC metadata), with
children `receive` (reading and parsing the body), `queue` (waiting in the dynamic batcher),
`compute` (the batched forward pass it shared, with the batch's number and size) and `respond`
(encoding the answer). The batcher times queue and compute with `time.perf_counter`; the spans
are written when the request ends, from those readings placed on the wall clock through one
anchor all requests share, so tracing adds nothing to the batcher's loop and the requests of a
batch show the same compute span. A request that fails ends its root span with an error status
and the children it reached.

Each batch is a span `hpcml.batch` of its own (its forward pass: model, version, batch number
and size) linking the root spans of the requests it served, written when the last of them
finishes (their samples add up to the batch's size); a batch one of whose requests never
finishes (a client gone after the forward pass) has none.
"""

from __future__ import annotations

import time
from typing import Any

from hpcml.serve.runtime.batcher import InferResult

_ANCHOR: tuple[int, float] = (time.time_ns(), time.perf_counter())
ANCHOR_EVERY_S = 60.0
_BATCHES: dict[tuple[str, str, int], tuple[int, list[Any]]] = {}
"""(model, version, batch) -> samples of its requests finished so far, their root spans' contexts."""
PENDING_BATCHES = 256


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

    def __init__(
        self, tracer: Any, protocol: str, model: str, version: str | None, carrier: Any = None
    ) -> None:
        from opentelemetry.propagate import extract

        self.tracer = tracer
        # The client's trace context (W3C traceparent/tracestate); an empty context without.
        self.parent = extract(carrier) if carrier else None
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
        from opentelemetry.trace import SpanKind, Status, StatusCode

        end = time.perf_counter()
        root = self.tracer.start_span(
            "hpcml.infer",
            context=self.parent,
            kind=SpanKind.SERVER,
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
        if r is not None and self.answered_at is not None:
            self._batch_served(root.get_span_context())

    def _batch_served(self, request_span: Any) -> None:
        """Count this request into its batch; the last one writes the batch's span."""
        from opentelemetry.trace import Link

        r = self.result
        assert r is not None
        key = (self.attributes["hpcml.model"], self.attributes["hpcml.version"], r.batch)
        samples, links = _BATCHES.pop(key, (0, []))
        samples, links = samples + len(r.output), [*links, Link(request_span)]
        if samples < r.batch_size:
            _BATCHES[key] = (samples, links)
            while len(_BATCHES) > PENDING_BATCHES:  # requests that never finished
                del _BATCHES[next(iter(_BATCHES))]
            return
        span = self.tracer.start_span(
            "hpcml.batch",
            start_time=self._ns(r.started),
            links=links,
            attributes={
                "hpcml.model": key[0], "hpcml.version": key[1],
                "hpcml.batch": r.batch, "hpcml.batch_size": r.batch_size,
            },
        )  # fmt: skip
        span.end(end_time=self._ns(r.started + r.compute_s))
