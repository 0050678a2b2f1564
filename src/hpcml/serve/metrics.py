"""Prometheus metrics of one server, in its own `CollectorRegistry` (two apps never collide).

Names follow Prometheus conventions: base units in the name (`_seconds`), `_total` on counters,
the response code in a `code` label. Histograms are named for what one observation is: a
request (`hpcml_request_*`: one per answered request) or a batch (`hpcml_batch_*`: one per
forward pass). Readiness is a gauge read from the router at scrape time, so it can never
disagree with `/v2/models/{name}/ready`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

# Latency buckets from 0.5 ms to 10 s: CPU models answer in ms, overloaded queues in seconds.
LATENCY_BUCKETS_S = (
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1.0,
    2.0,
    5.0,
    10.0,
)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


@dataclass
class BatcherMetrics:
    """The metric children of one model version, handed to its batcher."""

    batch_size: Any
    queue_s: Any
    compute_s: Any
    queue_depth: Any


class _Readiness(Collector):
    """`hpcml_model_ready{model,version}`: 1 while that version takes requests, else 0."""

    def __init__(self) -> None:
        self.source: Callable[[], Iterable[tuple[str, str, bool]]] = lambda: ()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "hpcml_model_ready",
            "1 while the model version is ready for inference requests, else 0.",
            labels=["model", "version"],
        )
        for model, version, ready in self.source():
            family.add_metric([model, version], 1.0 if ready else 0.0)
        yield family


# HTTP status -> gRPC status code name, for failures that have no more specific gRPC code: the
# values the `code` label of hpcml_requests_total takes on gRPC (the alert rules count them).
GRPC_CODE_OF_HTTP = {
    400: "INVALID_ARGUMENT",
    404: "NOT_FOUND",
    408: "DEADLINE_EXCEEDED",
    413: "RESOURCE_EXHAUSTED",
    429: "UNAVAILABLE",
    500: "INTERNAL",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}


class ServeMetrics:
    def __init__(self) -> None:
        self.tracer: Any = None
        """An OpenTelemetry tracer: a trace per request (hpcml.serve.protocol.spans); None: off."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "hpcml_requests_total",
            "Inference requests answered, by protocol (http, grpc) and response code "
            "(HTTP status, or gRPC status code name).",
            ["model", "version", "protocol", "code"],
            registry=r,
        )
        self.request_duration = Histogram(
            "hpcml_request_duration_seconds",
            "Per request: time from request parsed to answer ready (queue + batch compute).",
            ["model", "version", "protocol"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.queue_duration = Histogram(
            "hpcml_request_queue_seconds",
            "Per request: time it waited in the batch queue.",
            ["model", "version"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.batch_compute = Histogram(
            "hpcml_batch_compute_seconds",
            "Per batch: forward-pass time of one batch.",
            ["model", "version"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.batch_size = Histogram(
            "hpcml_batch_size",
            "Per batch: samples in one forward pass.",
            ["model", "version"],
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge(
            "hpcml_queue_depth",
            "Samples waiting in the batch queue.",
            ["model", "version"],
            registry=r,
        )
        self.worker_restarts = Counter(
            "hpcml_worker_restarts_total",
            "Inference worker processes restarted after they died.",
            ["model", "version"],
            registry=r,
        )
        self._readiness = _Readiness()
        r.register(self._readiness)
        self.shadow_requests = Counter(
            "hpcml_shadow_requests_total",
            "Requests mirrored to a shadow version, by outcome.",
            ["model", "version", "outcome"],
            registry=r,
        )
        self.shadow_samples = Counter(
            "hpcml_shadow_samples_total",
            "Samples compared between serving and shadow version.",
            ["model", "version"],
            registry=r,
        )
        self.shadow_disagreements = Counter(
            "hpcml_shadow_disagreements_total",
            "Samples whose shadow answer differs (top class for classifiers, else values).",
            ["model", "version"],
            registry=r,
        )
        self.shadow_latency = Histogram(
            "hpcml_shadow_latency_seconds",
            "Latency of mirrored requests on the shadow version.",
            ["model", "version"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )

        self.drift_psi = Gauge(
            "hpcml_input_drift_psi",
            "Population stability index of a feature's live inputs against the export's "
            "reference profile (hpcml.serve.traffic.drift).",
            ["model", "version", "feature"],
            registry=r,
        )
        self.drift_crossings = Counter(
            "hpcml_input_drift_crossings_total",
            "Times a version's largest feature PSI went from under to over drift.psi_threshold.",
            ["model", "version"],
            registry=r,
        )

    def for_batcher(self, model: str, version: str) -> BatcherMetrics:
        # Series that exist from the start, at 0: rate() and alerts then see the first restart.
        self.worker_restarts.labels(model, version)
        return BatcherMetrics(
            batch_size=self.batch_size.labels(model, version),
            queue_s=self.queue_duration.labels(model, version),
            compute_s=self.batch_compute.labels(model, version),
            queue_depth=self.queue_depth.labels(model, version),
        )

    def watch_readiness(self, source: Callable[[], Iterable[tuple[str, str, bool]]]) -> None:
        """Read `hpcml_model_ready` from `source() -> (model, version, ready)` at each scrape."""
        self._readiness.source = source
