"""The pipeline bubble as a share of a step: the time a stage waits while the pipeline fills
and drains, in the same model as `hpcml.plan.perf` (Narayanan et al. 2021, Sec. 2.2): with p
stages, m micro-batches and v stages per device (interleaved), the bubble lasts (p - 1) / v
micro-batch times against m of work, so its share is (p - 1) / (v m + p - 1); GPipe and 1F1B
(v = 1) give (p - 1) / (m + p - 1). Zero-bubble schedules fill it with weight-gradient work
that this model does not describe (None).

`replay` runs the same model on what a run measured instead of on equal stage times: the order
in which each rank ran its stages' actions and what each action cost. Communication and the
operating system cost nothing in it, as in the formula; so on balanced stages it gives the
formula's share, and what a run's wall clock adds beyond it is communication and waiting to be
scheduled, not the schedule."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

SINGLE_STAGE = ("gpipe", "1f1b")

Action = tuple[int, str, int]
"""(stage index, kind, micro-batch). Kinds: "F" forward, "L" the loss (last stage, after its
forward), "B" backward (the whole backward, or the input gradients under zero-bubble), "W" the
weight gradients (zero-bubble)."""


def bubble_share(pp: int, microbatches: int, schedule: str, virtual: int = 1) -> float | None:
    """The share of a step each stage idles in the fill and drain, or None (not modelled)."""
    if pp == 1:
        return 0.0
    if schedule == "zero_bubble":
        return None
    v = 1 if schedule in SINGLE_STAGE else virtual
    return (pp - 1) / (v * microbatches + pp - 1)


def _needs(action: Action, last_stage: int, known: set[Action]) -> Action | None:
    """The action of the same micro-batch that must end before `action` starts (None: none)."""
    stage, kind, mb = action
    if kind == "F":
        need: Action = (stage - 1, "F", mb)
    elif kind == "L":
        need = (stage, "F", mb)
    elif kind == "W":
        need = (stage, "B", mb)
    elif stage == last_stage:  # the backward starts from the loss (or the output)
        need = (stage, "L", mb) if (stage, "L", mb) in known else (stage, "F", mb)
    else:
        need = (stage + 1, "B", mb)
    return need if need in known else None


def replay(
    orders: Mapping[int, Sequence[Action]],
    costs: Mapping[int, Mapping[Action, float]],
    latency_s: float = 0.0,
) -> dict[int, float]:
    """Each rank's idle share of one step of one pipeline: every rank runs its actions in its
    `orders` (as it ran them), each as soon as the action it needs has ended (the previous
    stage's forward, the next stage's backward), for `costs[rank][action]` seconds; an action
    needed from another rank arrives `latency_s` after it ended (a message). The step lasts
    until the last action ends; a rank's idle share is the part of it the rank did not
    compute. Raises ValueError if the orders cannot all run (a rank waits for an action that
    waits for it)."""
    owner = {a: rank for rank, order in orders.items() for a in order}
    known = set(owner)
    last_stage = max((a[0] for a in known), default=0)
    ended: dict[Action, float] = {}
    now = dict.fromkeys(orders, 0.0)
    busy = dict.fromkeys(orders, 0.0)
    nxt = dict.fromkeys(orders, 0)
    moved = True
    while moved:
        moved = False
        for rank, order in orders.items():
            while nxt[rank] < len(order):
                action = order[nxt[rank]]
                need = _needs(action, last_stage, known)
                if need is not None and need not in ended:
                    break
                cost = costs[rank][action]
                ready = 0.0
                if need is not None:
                    ready = ended[need] + (latency_s if owner[need] != rank else 0.0)
                ended[action] = max(now[rank], ready) + cost
                now[rank] = ended[action]
                busy[rank] += cost
                nxt[rank] += 1
                moved = True
    stuck = [r for r, order in orders.items() if nxt[r] < len(order)]
    if stuck:
        raise ValueError(f"ranks {stuck} wait for actions that never run: not a pipeline order")
    span = max(now.values(), default=0.0)
    return {r: 1.0 - busy[r] / span if span > 0 else 0.0 for r in orders}
