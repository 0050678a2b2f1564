"""Per-version request statistics (Triton's `inference_stats`), kept by `InferStats`, which
`protocol.inference.run_infer` updates as requests end; the batcher keeps per-batch-size counts
in its `BatchingStats`. `protocol.triton_config` answers both in Triton's forms. A
`RequestWindow` attached to a version's stats collects what a canary judges (latencies of
successful requests, server errors) from the moment it is attached.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

BUCKETS_PER_DOUBLING = 70
"""Latency buckets of a `RequestWindow`: 70 per doubling, each 2^(1/70) - 1 = 0.99% wide."""


@dataclass
class RequestWindow:
    """One version's requests since the window was attached (a canary step): the latencies of
    the successful ones in logarithmic buckets (0.99% wide, so memory and the p99's cost stay
    bounded however many requests a step sees: a few hundred buckets, not 8 bytes a request
    sorted at every check) and the number answered with a server error (5xx)."""

    started_s: float = field(default_factory=time.monotonic)
    buckets: dict[int, int] = field(default_factory=dict)
    answered: int = 0
    """Successful requests."""
    server_errors: int = 0

    def add(self, latency_s: float) -> None:
        """A successful request's latency."""
        b = math.floor(math.log2(max(latency_s, 1e-9)) * BUCKETS_PER_DOUBLING)
        self.buckets[b] = self.buckets.get(b, 0) + 1
        self.answered += 1

    @property
    def requests(self) -> int:
        return self.answered + self.server_errors

    @property
    def error_rate(self) -> float:
        return self.server_errors / self.requests if self.requests else 0.0

    def p99_ms(self) -> float | None:
        """Nearest-rank 99th percentile of the successful requests' latency, as the upper edge
        of its bucket (at most 0.99% above the request's own latency, never below it; None:
        no request yet)."""
        if self.answered == 0:
            return None
        rank, seen = max(math.ceil(0.99 * self.answered), 1), 0
        for b in sorted(self.buckets):
            seen += self.buckets[b]
            if seen >= rank:
                return 2.0 ** ((b + 1) / BUCKETS_PER_DOUBLING) * 1000.0
        raise AssertionError("unreachable: the counts sum to `answered`")


@dataclass
class InferStats:
    """Cumulative request statistics of one model version (Triton's `inference_stats`)."""

    success_count: int = 0
    success_ns: int = 0
    fail_count: int = 0
    fail_ns: int = 0
    queue_ns: int = 0
    compute_ns: int = 0
    inference_count: int = 0
    """Samples answered (a request of batch 4 counts 4, as Triton counts)."""
    last_inference_ms: int = 0
    window: RequestWindow | None = None
    """Where a canary collects this version's requests while it judges them; None otherwise."""

    def succeeded(self, duration_s: float, queue_s: float, compute_s: float, samples: int) -> None:
        self.success_count += 1
        self.success_ns += int(duration_s * 1e9)
        self.queue_ns += int(queue_s * 1e9)
        self.compute_ns += int(compute_s * 1e9)
        self.inference_count += samples
        self.last_inference_ms = int(time.time() * 1000)
        if self.window is not None:
            self.window.add(duration_s)

    def failed(self, duration_s: float, server_error: bool = True) -> None:
        """`server_error`: the server's fault (5xx), not the client's (4xx)."""
        self.fail_count += 1
        self.fail_ns += int(duration_s * 1e9)
        if self.window is not None and server_error:
            self.window.server_errors += 1
