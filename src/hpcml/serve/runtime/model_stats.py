"""Per-version request statistics (Triton's `inference_stats`), kept by `InferStats`, which
`protocol.inference.run_infer` updates as requests end; the batcher keeps per-batch-size counts
in its `BatchingStats`. `protocol.triton_config` answers both in Triton's forms.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


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

    def succeeded(self, duration_s: float, queue_s: float, compute_s: float, samples: int) -> None:
        self.success_count += 1
        self.success_ns += int(duration_s * 1e9)
        self.queue_ns += int(queue_s * 1e9)
        self.compute_ns += int(compute_s * 1e9)
        self.inference_count += samples
        self.last_inference_ms = int(time.time() * 1000)

    def failed(self, duration_s: float) -> None:
        self.fail_count += 1
        self.fail_ns += int(duration_s * 1e9)
