"""Prometheus metrics of one server, in its own `CollectorRegistry` (two apps never collide).

Requests by model, version and status; latency histograms (total, queue, compute); batch
sizes; queue depth; shadow traffic and its disagreements with the serving version.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

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


class ServeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "hpcml_requests_total",
            "Inference requests answered, by HTTP status.",
            ["model", "version", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "hpcml_request_latency_seconds",
            "Time from request received to response ready.",
            ["model", "version"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.queue_latency = Histogram(
            "hpcml_queue_latency_seconds",
            "Time a request waited in the batch queue.",
            ["model", "version"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.compute_latency = Histogram(
            "hpcml_compute_latency_seconds",
            "Forward-pass time of the batch a request rode in.",
            ["model", "version"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.batch_size = Histogram(
            "hpcml_batch_size",
            "Samples per forward pass.",
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

    def for_batcher(self, model: str, version: str) -> BatcherMetrics:
        return BatcherMetrics(
            batch_size=self.batch_size.labels(model, version),
            queue_s=self.queue_latency.labels(model, version),
            compute_s=self.compute_latency.labels(model, version),
            queue_depth=self.queue_depth.labels(model, version),
        )
