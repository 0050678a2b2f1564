"""The planner's pipeline bubble share, against the numbers of Narayanan et al. 2021."""

from __future__ import annotations

import pytest

from hpcml.plan.bubble import Action, bubble_share, replay


def test_bubble_shares() -> None:
    assert bubble_share(1, 4, "1f1b") == 0.0
    # (p - 1) / (m + p - 1): 4 stages, 8 micro-batches -> 3 / 11 for GPipe and 1F1B alike.
    assert bubble_share(4, 8, "gpipe") == bubble_share(4, 8, "1f1b") == pytest.approx(3 / 11)
    assert bubble_share(2, 2, "1f1b") == pytest.approx(1 / 3)
    # Interleaving v stages per device divides the bubble time by v: (p - 1) / (v m + p - 1).
    assert bubble_share(4, 8, "interleaved_1f1b", virtual=2) == pytest.approx(3 / 19)
    assert bubble_share(4, 8, "gpipe", virtual=2) == pytest.approx(3 / 11)  # v: interleaved only
    assert bubble_share(2, 4, "zero_bubble") is None


def gpipe(stage: int, m: int) -> list[Action]:
    return [(stage, "F", i) for i in range(m)] + [(stage, "B", i) for i in range(m)]


def one_f_one_b(stage: int, p: int, m: int) -> list[Action]:
    """Warm-up forwards (p - 1 - stage), then one forward and one backward in turn, then the
    remaining backwards (Narayanan et al. 2021, Fig. 4)."""
    warm = min(m, p - 1 - stage)
    order: list[Action] = [(stage, "F", i) for i in range(warm)]
    for i in range(m - warm):
        order += [(stage, "F", warm + i), (stage, "B", i)]
    return order + [(stage, "B", i) for i in range(m - warm, m)]


def unit_costs(orders: dict[int, list[Action]], f: float = 1.0) -> dict[int, dict[Action, float]]:
    # A backward costs twice its forward (two matrix products per one), as in hpcml.plan.perf.
    return {r: {a: f * (1.0 if a[1] == "F" else 2.0) for a in o} for r, o in orders.items()}


@pytest.mark.parametrize("p,m", [(2, 2), (2, 4), (2, 8), (4, 8), (3, 5)])
def test_replaying_gpipe_and_1f1b_on_equal_stages_gives_the_formula(p: int, m: int) -> None:
    for orders in (
        {s: gpipe(s, m) for s in range(p)},
        {s: one_f_one_b(s, p, m) for s in range(p)},
    ):
        idle = replay(orders, unit_costs(orders))
        # Every stage idles p - 1 stage-times (F + B) of the m + p - 1 the step lasts.
        for rank in range(p):
            assert idle[rank] == pytest.approx(bubble_share(p, m, "1f1b")), (orders, rank)


def test_replay_on_unequal_stages_waits_for_the_slower_one() -> None:
    # Stage 1 costs twice stage 0: r0 F0 [0,1] F1 [1,2]; r1 F0 [1,3] F1 [3,5] B0 [5,9] B1
    # [9,13]; r0 B0 [9,11] B1 [13,15]. 15 long: r0 computed 6 (idle 0.6), r1 12 (idle 0.2).
    orders = {0: gpipe(0, 2), 1: gpipe(1, 2)}
    costs = unit_costs(orders)
    costs[1] = {a: 2 * c for a, c in costs[1].items()}
    assert replay(orders, costs) == {0: pytest.approx(0.6), 1: pytest.approx(0.2)}


def test_replay_orders_the_loss_and_weight_gradients_after_their_inputs() -> None:
    # The last stage's loss runs after its forward and before its backward, and counts as its
    # work; a weight-gradient action (zero-bubble) follows its input-gradient backward.
    # r1: F0 [1,2] L0 [2,3] B0 [3,5]; r0: F0 [0,1] B0 [5,7] W0 [7,8]: 8 long, each computed 4.
    orders = {
        0: [(0, "F", 0), (0, "B", 0), (0, "W", 0)],
        1: [(1, "F", 0), (1, "L", 0), (1, "B", 0)],
    }
    costs = {0: {(0, "F", 0): 1.0, (0, "B", 0): 2.0, (0, "W", 0): 1.0}, 1: {}}
    costs[1] = {(1, "F", 0): 1.0, (1, "L", 0): 1.0, (1, "B", 0): 2.0}
    assert replay(orders, costs) == {0: pytest.approx(0.5), 1: pytest.approx(0.5)}


def test_replay_refuses_orders_that_wait_on_each_other() -> None:
    # Stage 0 runs its backward before the forward stage 1 needs from it: neither can start.
    orders = {0: [(0, "B", 0), (0, "F", 0)], 1: [(1, "F", 0), (1, "B", 0)]}
    with pytest.raises(ValueError, match="never run"):
        replay(orders, unit_costs(orders))


def test_replay_delays_only_what_crosses_ranks_by_the_latency() -> None:
    # GPipe, 2 stages, 1 micro-batch, F 1 and B 2, messages 0.5: r0 F [0,1]; r1 F [1.5,2.5]
    # B [2.5,4.5]; r0 B [5,7]. 7 long, each rank computed 3. The same stages on one rank
    # (a rank's own actions) wait for nothing: 6 long, idle 0.
    orders = {0: gpipe(0, 1), 1: gpipe(1, 1)}
    idle = replay(orders, unit_costs(orders), latency_s=0.5)
    assert idle == {0: pytest.approx(4 / 7), 1: pytest.approx(4 / 7)}
    one = {0: [(0, "F", 0), (1, "F", 0), (1, "B", 0), (0, "B", 0)]}
    assert replay(one, unit_costs(one), latency_s=0.5) == {0: pytest.approx(0.0)}
