"""The pipeline bubble as a share of a step: the time a stage waits while the pipeline fills
and drains, in the same model as `hpcml.plan.perf` (Narayanan et al. 2021, Sec. 2.2): with p
stages, m micro-batches and v stages per device (interleaved), the bubble lasts (p - 1) / v
micro-batch times against m of work, so its share is (p - 1) / (v m + p - 1); GPipe and 1F1B
(v = 1) give (p - 1) / (m + p - 1). Zero-bubble schedules fill it with weight-gradient work
that this model does not describe (None)."""

from __future__ import annotations

SINGLE_STAGE = ("gpipe", "1f1b")


def bubble_share(pp: int, microbatches: int, schedule: str, virtual: int = 1) -> float | None:
    """The share of a step each stage idles in the fill and drain, or None (not modelled)."""
    if pp == 1:
        return 0.0
    if schedule == "zero_bubble":
        return None
    v = 1 if schedule in SINGLE_STAGE else virtual
    return (pp - 1) / (v * microbatches + pp - 1)
