"""The memory probe under every parallel strategy on 2 gloo processes: gpt-tiny wrapped as
`hpcml train` wraps it (ddp, zero1, zero2, zero3 through FSDP2, tp and tp + sequence
parallelism through DTensor), one measured training step each, then the planner's prediction
for each run's summary (the same path `hpcml train` writes into summary.json) must match the
busiest rank's measurement within the memory goal.

zero1 is torch's ZeroRedundancyOptimizer, which gives each rank whole parameter tensors: the
zoo MLP (one tensor is 92% of it) and gpt-tiny with hpcml's two weight-decay groups check that
the planner predicts each rank's optimizer state as torch partitions it, not as an even split.

One spawn of two processes runs all set-ups in turn to keep this test short.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from hpcml.plan.hardware import load_catalog
from hpcml.plan.predict import predict_summary

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ARGS = {"max_seq_len": 64}
BATCH = 4
# (model, strategy, tp, sequence parallel, weight decay)
CASES = [
    ("gpt-tiny", "ddp", 1, False, 0.0),
    ("gpt-tiny", "zero1", 1, False, 0.0),
    ("gpt-tiny", "zero1", 1, False, 0.1),
    ("mlp", "zero1", 1, False, 0.0),
    ("gpt-tiny", "zero2", 1, False, 0.0),
    ("gpt-tiny", "zero3", 1, False, 0.0),
    ("gpt-tiny", "zero3", 2, False, 0.0),
    ("gpt-tiny", "zero3", 2, True, 0.0),
]
IDS = [f"{m}-{s}-tp{t}{'-sp' if p else ''}{'-wd' if w else ''}" for m, s, t, p, w in CASES]


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world),
        }
    )
    torch.set_num_threads(1)
    from hpcml.config import OptimConfig, ParallelConfig, TrainConfig
    from hpcml.distributed.parallel import (
        local_state_bytes,
        parallelize,
        shard_optimizer,
        unwrap,
    )
    from hpcml.distributed.runtime import all_gather_object, init_runtime, shutdown
    from hpcml.models.zoo import build_model, count_parameters
    from hpcml.train.losses import cross_entropy
    from hpcml.train.memprobe import SavedActivationProbe
    from hpcml.train.peaktrace import StepPeak
    from hpcml.train.schedule import param_groups

    base = init_runtime("cpu", "gloo", 120.0)
    results = []
    for name, strategy, tp, sp, decay in CASES:
        rt = dataclasses.replace(base, tp=tp)
        torch.manual_seed(0)
        args = dict(ARGS) if name.startswith("gpt") else {}
        model = build_model(name, dict(args))
        n_params = count_parameters(model)
        cfg = ParallelConfig(strategy=strategy, tp=tp, sequence_parallel=sp)
        model = parallelize(model, rt, cfg, TrainConfig(), "fp32")
        optim = OptimConfig(name="adamw", lr=1e-3, weight_decay=decay)
        opt = shard_optimizer(
            torch.optim.AdamW(param_groups(model, optim), lr=1e-3, weight_decay=decay),
            model,
            rt,
            cfg,
        )
        g = torch.Generator().manual_seed(rt.dp_rank)
        if name.startswith("gpt"):
            x = torch.randint(0, 256, (BATCH, ARGS["max_seq_len"]), generator=g)
            y = torch.randint(0, 256, (BATCH, ARGS["max_seq_len"]), generator=g)
        else:
            x = torch.randn(BATCH, 3, 32, 32, generator=g)
            y = torch.randint(0, 10, (BATCH,), generator=g)
        probe = SavedActivationProbe(model)
        peak = StepPeak(model, opt, last=3, enabled=True)  # traces the third, steady step
        for step in (1, 2, 3):
            with peak.step(step):
                opt.zero_grad(set_to_none=True)  # as the Trainer's step begins
                with probe.sample():
                    loss = cross_entropy(model(x), y)
                loss.backward()
                opt.step()
        mem: dict[str, Any] = local_state_bytes(unwrap(model), opt)
        mem.update(probe.result(rt.device))
        mem.update(peak.result())
        per_rank = all_gather_object(rt, mem)
        results.append(
            {
                "world_size": world,
                "device": {"type": "cpu", "name": "cpu"},
                "precision": "fp32",
                "config": {
                    "model": {"name": name, "args": args},
                    "data": {"batch_size": BATCH},
                    "parallel": {"strategy": strategy, "tp": tp, "sequence_parallel": sp},
                    "optim": {"name": "adamw", "weight_decay": decay},
                    "train": {"grad_accum": 1, "max_steps": 3},
                },
                "model": {"name": name, "args": args, "parameters": n_params},
                "memory": {"per_rank": per_rank},
            }
        )
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    shutdown(base)


@pytest.fixture(scope="module")
def summaries(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("memprobe") / "results.json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(2, port, str(out)), nprocs=2, join=True)
    return list(json.loads(out.read_text()))


@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
def test_prediction_matches_the_probe(summaries: list[dict[str, Any]], case: int) -> None:
    summary = summaries[case]
    per_rank = summary["memory"]["per_rank"]
    assert all(r["saved_activation_bytes"] > 0 for r in per_rank)
    pred = predict_summary(summary, load_catalog())
    rows = {r["quantity"]: r for r in pred["rows"]}
    for q in ("model_states_bytes", "activations_bytes", "states_plus_activations_bytes"):
        # The memory goal of issue 12; the formulas leave out norms' statistics and the
        # replicated biases and norms under tensor parallelism (4% of gpt-tiny's parameters).
        assert rows[q]["ok"], (q, rows[q])


@pytest.mark.parametrize("case", [i for i, c in enumerate(CASES) if c[1] == "zero1"])
def test_zero1_state_is_whole_tensors_per_rank(summaries: list[dict[str, Any]], case: int) -> None:
    """The planner's busiest-rank optimizer state is torch's, to the byte: its restatement of
    ZeroRedundancyOptimizer's greedy partition (hpcml.plan.zero1) against the state tensors
    each rank really holds. An even split (the ZeRO paper's formula) misses mlp by 46%."""
    summary = summaries[case]
    measured = [r["optimizer_bytes"] for r in summary["memory"]["per_rank"]]
    rows = {r["quantity"]: r for r in predict_summary(summary, load_catalog())["rows"]}
    assert rows["optimizer_bytes"]["predicted"] == max(measured)
    # The two ranks really are uneven here, so an even split cannot pass by luck.
    assert max(measured) > 1.02 * min(measured)


def test_sharding_shows_in_the_measurement(summaries: list[dict[str, Any]]) -> None:
    by = {
        (
            s["config"]["parallel"]["strategy"],
            s["config"]["parallel"]["tp"],
            s["config"]["parallel"]["sequence_parallel"],
        ): s["memory"]["per_rank"]
        for s, c in zip(summaries, CASES, strict=True)
        if c[0] == "gpt-tiny" and not c[4]
    }
    for ddp, z3 in zip(by[("ddp", 1, False)], by[("zero3", 1, False)], strict=True):
        assert z3["model_states_bytes"] < 0.6 * ddp["model_states_bytes"]
        # ZeRO-3's gathered weights saved for backward count as parameters, not activations,
        # on every rank: the same tensors are saved, whatever addresses FSDP2's frees leave
        # to the allocator (keyed by address, one 64 KiB activation moved between the two).
        assert z3["saved_activation_bytes"] == ddp["saved_activation_bytes"]
        assert z3["saved_param_bytes"] == ddp["saved_param_bytes"]
    ddp = by[("ddp", 1, False)][0]
    tp, tpsp = by[("zero3", 2, False)][0], by[("zero3", 2, True)][0]
    assert (
        tpsp["saved_activation_bytes"]
        < tp["saved_activation_bytes"]
        < ddp["saved_activation_bytes"]
    )


@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
def test_peak_is_checked_on_every_rank(summaries: list[dict[str, Any]], case: int) -> None:
    """plan check's peak rows: the busiest rank's and each rank's measured peak (the second
    step traced by allocation as it ran, hpcml.train.peaktrace) against the prediction."""
    summary = summaries[case]
    per_rank = summary["memory"]["per_rank"]
    rows = {r["quantity"]: r for r in predict_summary(summary, load_catalog())["rows"]}
    measured = [r["traced_peak_bytes"] for r in per_rank]
    assert rows["peak_bytes"]["measured"] == max(measured)
    for rank, m in enumerate(measured):
        row = rows[f"peak_bytes rank {rank}"]
        assert row["measured"] == m and row["predicted"] == rows["peak_bytes"]["predicted"]
    for r in per_rank:
        # what was alive at the peak adds up to it, and the rank's parameters were in it
        assert sum(r["traced_at_peak"].values()) == r["traced_peak_bytes"]
        assert r["traced_at_peak"]["params"] == r["params_bytes"]
    if CASES[case][1] == "ddp":
        # DDP's buckets hold every gradient from one step to the next (zero_grad drops the
        # views, not the buckets): alive at the peak, which a tracer blind to them misses.
        assert all(r["traced_at_peak"]["grads"] == r["grads_bytes"] for r in per_rank)
