"""The pipeline bubble of GPipe and 1F1B at m = 2, 4 and 8 micro-batches, as the schedules of
`torch.distributed.pipelining` run on 2 gloo processes (stages built as `hpcml train` builds
them: `hpcml.distributed.pipeline`), against the planner (`hpcml.plan`):

- the order each rank ran its actions in is the schedule's: GPipe all forwards then all
  backwards; 1F1B holds at most the planner's in-flight micro-batches on the first stage
  (`inflight_microbatches`, min(p, m)) where GPipe holds all m;
- the bubble replayed from that order (`hpcml.train.pipeline.replayed_idle`: what
  `summary.json`'s `replayed_bubble` is), each kind of action costing its median CPU time
  averaged over the stages, is within 10% of the planner's (p - 1) / (m + p - 1) (the issue's
  bound is 25%); with each stage's own costs it is a share.

No wall-clock time is compared: on a shared 2-core machine a run's wall-clock idle share is
mostly waiting for the operating system and gloo (0.64-0.74 measured where the planner says
0.11-0.20); CPU time and the order do not depend on the machine's load.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
from tests import forked

from hpcml.plan.activations import inflight_microbatches
from hpcml.plan.bubble import bubble_share
from hpcml.train.pipeline import replayed_idle

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CASES = [(s, m) for s in ("gpipe", "1f1b") for m in (2, 4, 8)]
# 4 blocks, 2 per stage; the embedding (a lookup) on the first stage, the final norm, the head
# and the loss on the last. The 256-token head makes the last stage the busier one in both the
# forward and the backward (measured: by 3-10%): with stages this close, a stage costing a
# few percent more in one phase and less in the other (noise, when the head is small) would
# leave both idle more than the formula, by ~m times the difference.
MODEL = {"vocab_size": 256, "max_seq_len": 32, "n_layer": 4, "n_head": 2, "d_model": 96}
BATCH, STEPS = 16, 6  # the first step infers shapes and is not recorded (as in training)


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "2",
        }
    )
    torch.set_num_threads(1)
    from hpcml.config import ParallelConfig
    from hpcml.distributed import meta_init, pipeline
    from hpcml.distributed.runtime import all_gather_object, init_runtime, shutdown
    from hpcml.models.zoo import build_model
    from hpcml.train.losses import cross_entropy

    rt = init_runtime("cpu", "gloo", 120.0, 1, 2)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, MODEL["vocab_size"], (BATCH, MODEL["max_seq_len"]), generator=g)
    y = torch.randint(0, MODEL["vocab_size"], (BATCH, MODEL["max_seq_len"]), generator=g)
    results: list[Any] = []
    for name, m in CASES:
        cfg = ParallelConfig(pp=2, pp_schedule=name, microbatches=m)
        with torch.device("meta"):
            meta = build_model("gpt-tiny", {**MODEL, "tie_embeddings": False})
        part = pipeline.split_model(meta, rt, cfg)
        meta_init.materialize(part, rt.device, 0, {})
        part.pipeline_group, _ = pipeline.process_groups(rt)

        def loss_fn(out: torch.Tensor, target: torch.Tensor, m: int = m) -> torch.Tensor:
            return cross_entropy(out, target) / m

        schedule, clock = pipeline.build_schedule(part, part, rt, cfg, loss_fn, part.pipeline_group)
        first, last = pipeline.is_first(part), pipeline.is_last(part, cfg)
        for step in range(STEPS):
            part.zero_grad(set_to_none=True)
            with clock.step(record=step > 0):
                schedule.step(*((x,) if first else ()), target=y if last else None, losses=[])
        results.append(all_gather_object(rt, {"pipeline": 0, **clock.replayed()}))
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    shutdown(rt)


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> list[list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("bubble") / "orders.json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Forked from tests/forked.py's server, which imported torch and the trainer once.
    forked.start_ranks(_worker, (port, str(out)))
    return list(json.loads(out.read_text()))


def peak_inflight(order: list[tuple[int, str, int]]) -> int:
    """The most micro-batches forwarded and not yet backwarded at once."""
    held = peak = 0
    for _, kind, _ in order:
        held += {"F": 1, "B": -1}.get(kind, 0)
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{s}-m{m}" for s, m in CASES])
def test_schedule_order_and_replayed_bubble_are_the_planners(
    measured: list[list[dict[str, Any]]], case: int
) -> None:
    name, m = CASES[case]
    ranks = measured[case]
    orders = [[tuple(a) for a in r["order"]] for r in ranks]
    # Every action once: each stage's m forwards and m backwards, the last stage's m losses.
    assert sorted(orders[0]) == sorted([(0, k, i) for k in "FB" for i in range(m)])
    assert sorted(orders[1]) == sorted([(1, k, i) for k in "FLB" for i in range(m)])
    if name == "gpipe":
        assert orders[0] == [(0, "F", i) for i in range(m)] + [(0, "B", i) for i in range(m)]
        assert peak_inflight(orders[0]) == m
    else:
        assert peak_inflight(orders[0]) == inflight_microbatches(2, m, "1f1b", 1) == min(2, m)
    # The replay on the order each rank ran, with each kind of action costing the same on
    # both stages (its median CPU time averaged over the stages): the planner's formula is
    # for equal stages, so with them the busiest stage's idle share is (p - 1) / (m + p - 1)
    # up to the loss (one last-stage action ~3% of a forward, measured), inside 10%.
    # Averaging removes what the machine decides: which stage is heavier in which phase
    # (a last stage 3% lighter in the backward and heavier in the forward left both idle
    # 0.145-0.19 at gpipe m = 8 on CI's CPU where this one measured 3-8% below the formula).
    idle = replayed_idle(_equal_stages(ranks))
    predicted = bubble_share(2, m, name)
    assert predicted is not None
    assert min(idle) == pytest.approx(predicted, rel=0.10), (idle, predicted)
    # The replay with each stage's own costs (summary.json's replayed_bubble): a share.
    own = replayed_idle(ranks)
    assert all(0 < share < 1 for share in own)


def _equal_stages(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`ranks` with each action's CPU time the mean over the stages of its kind's."""
    per_kind: dict[str, list[float]] = {}
    for r in ranks:
        seen = {a[1]: c for a, c in zip(r["order"], r["cpu_s"], strict=True)}
        for kind, cost in seen.items():
            per_kind.setdefault(kind, []).append(cost)
    mean = {k: sum(v) / len(v) for k, v in per_kind.items()}
    return [{**r, "cpu_s": [mean[a[1]] for a in r["order"]]} for r in ranks]
