"""Per-version request statistics (Triton's `inference_stats`), kept by `InferStats`, which
`protocol.inference.run_infer` updates as requests end; the batcher keeps per-batch-size counts
in its `BatchingStats`. `protocol.triton_config` answers both in Triton's forms. A
`RequestWindow` attached to a version's stats collects what a canary judges (latencies of
successful requests, server errors) from the moment it is attached.
"""

from __future__ import annotations

import math
import time
from array import array
from dataclasses import dataclass, field


@dataclass
class RequestWindow:
    """One version's requests since the window was attached (a canary step): the latency of
    each successful one and the number answered with a server error (5xx)."""

    started_s: float = field(default_factory=time.monotonic)
    latencies_s: array[float] = field(default_factory=lambda: array("d"))
    """8 bytes a request: a minute at 10,000 requests/s holds under 5 MB."""
    server_errors: int = 0

    @property
    def requests(self) -> int:
        return len(self.latencies_s) + self.server_errors

    @property
    def error_rate(self) -> float:
        return self.server_errors / self.requests if self.requests else 0.0

    def p99_ms(self) -> float | None:
        """Nearest-rank 99th percentile of the successful requests' latency (None: none)."""
        n = len(self.latencies_s)
        if n == 0:
            return None
        return sorted(self.latencies_s)[max(math.ceil(0.99 * n) - 1, 0)] * 1000.0


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
            self.window.latencies_s.append(duration_s)

    def failed(self, duration_s: float, server_error: bool = True) -> None:
        """`server_error`: the server's fault (5xx), not the client's (4xx)."""
        self.fail_count += 1
        self.fail_ns += int(duration_s * 1e9)
        if self.window is not None and server_error:
            self.window.server_errors += 1
