"""Headroom: how far a predicted peak is from the memory a plan may use, in one line."""

from __future__ import annotations

# A plan that fits with less than this share of its memory budget left is flagged: the
# activation formula alone was x1.21 off on a stock Llama block (issue 37), and a longer
# sequence or another allocator split moves a few percent.
THIN_HEADROOM = 0.10


def headroom_verdict(peak_bytes: float, budget_bytes: float | None) -> tuple[str, bool]:
    """One line saying whether `peak_bytes` fits `budget_bytes` and by how much, and whether
    the margin is thin (under THIN_HEADROOM of the budget, or over it)."""
    if budget_bytes is None:
        return "host memory: not checked", False
    room = budget_bytes - peak_bytes
    share = room / budget_bytes if budget_bytes > 0 else -1.0
    if room < 0:
        return f"does NOT fit: {-room / 1e9:,.2f} GB over the budget ({-share:.1%})", True
    line = f"fits with {room / 1e9:,.2f} GB headroom ({share:.1%} of the budget)"
    if share < THIN_HEADROOM:
        line += (
            f"; under {THIN_HEADROOM:.0%}: a longer sequence, allocator fragmentation or the "
            "prediction's own error can tip it into an out-of-memory error"
        )
        return line, True
    return line, False
