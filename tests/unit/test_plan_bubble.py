"""The planner's pipeline bubble share, against the numbers of Narayanan et al. 2021."""

from __future__ import annotations

import pytest

from hpcml.plan.bubble import bubble_share


def test_bubble_shares() -> None:
    assert bubble_share(1, 4, "1f1b") == 0.0
    # (p - 1) / (m + p - 1): 4 stages, 8 micro-batches -> 3 / 11 for GPipe and 1F1B alike.
    assert bubble_share(4, 8, "gpipe") == bubble_share(4, 8, "1f1b") == pytest.approx(3 / 11)
    assert bubble_share(2, 2, "1f1b") == pytest.approx(1 / 3)
    # Interleaving v stages per device divides the bubble time by v: (p - 1) / (v m + p - 1).
    assert bubble_share(4, 8, "interleaved_1f1b", virtual=2) == pytest.approx(3 / 19)
    assert bubble_share(4, 8, "gpipe", virtual=2) == pytest.approx(3 / 11)  # v: interleaved only
    assert bubble_share(2, 4, "zero_bubble") is None
