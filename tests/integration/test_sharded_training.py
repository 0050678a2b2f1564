"""Sharded and tensor-parallel training of gpt-tiny on 2 CPU processes (gloo), end to end
through torchrun with 2 workers (as `hpcml train --nproc 2` starts them):

- equivalence: 10 fp32 steps give the same loss at every step under ddp, zero1, zero2,
  zero3 and tp=2 as one process with the same global batch (1e-4 relative);
- exports are the full, unsharded model whatever the strategy;
- memory: zero3 holds about half the model-state bytes per rank that ddp holds;
- evaluation: 33 validation windows split over 2 data-parallel ranks (17 and 16, so 2 and 1
  eval batches of 16 before padding) finish under zero3 and tp with the one-process result;
- resharding: a zero3 checkpoint written by 2 ranks resumes under ddp (continuing the same
  losses) and on 1 rank; a zero1 checkpoint resumes under zero3.

One module fixture runs each training once; the tests read their run folders.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tests.conftest import hpcml_proc, summary
from tests.conftest import step_losses as losses

from hpcml.data.sources.tokens import prepare_pystdlib

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "tp"]
# Sharded runs average fp32 gradients in another order (gloo, deterministic on CPU) than one
# process: ~u = 6e-8 per step, grown by 10 AdamW steps. An estimate (~1000 u), not a bound.
REL = 1e-4

CONFIG = """
model: {{name: gpt-tiny}}
data: {{source: tokens, path: {corpus}, seq_len: 64, batch_size: 8, eval_windows: 33}}
optim: {{name: adamw, lr: 0.003, warmup_steps: 2, grad_clip: 1.0}}
train: {{max_steps: 10, eval_every: 0, checkpoint_every: 5, keep_last: 2, log_every: 5}}
precision: fp32
"""


def train(
    config: Path, run_dir: Path, nproc: int, *overrides: str, resume: str | None = None
) -> None:
    # Forked from the pre-imported server (conftest); with --nproc, torchrun's agent runs in
    # that process and forks the workers (hpcml.launch.forked_workers): no new interpreter.
    args = ["train", str(config), *overrides, "--run-dir", str(run_dir), "--quiet"]
    if nproc > 1:
        args += ["--nproc", str(nproc)]
    if resume:
        args += ["--resume", resume]
    out = hpcml_proc(args, timeout=600)
    assert out.returncode == 0, (
        f"hpcml {' '.join(args)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sharded")
    corpus = root / "pystdlib"
    prepare_pystdlib(corpus, val_fraction=0.2, max_bytes=1_000_000)
    config = root / "gpt_tiny.yaml"
    config.write_text(CONFIG.format(corpus=corpus))
    out = {"config": config}
    # One process with the global batch (2 x 8) of the data-parallel runs.
    out["single"] = root / "single"
    train(config, out["single"], 1, "data.batch_size=16")
    for strategy in STRATEGIES:
        out[strategy] = root / strategy
        if strategy == "tp":  # both ranks hold one replica: it takes the whole batch
            train(config, out[strategy], 2, "parallel.tp=2", "data.batch_size=16")
        else:
            train(config, out[strategy], 2, f"parallel.strategy={strategy}")
    return out


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_same_loss_every_step_as_one_process(runs: dict[str, Path], strategy: str) -> None:
    want, got = losses(runs["single"]), losses(runs[strategy])
    assert sorted(got) == list(range(1, 11))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=REL), f"{strategy} step {step}"
    assert want[10] < want[1]  # it did learn something


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_export_is_the_full_model(runs: dict[str, Path], strategy: str) -> None:
    want = load_file(str(runs["single"] / "export" / "model.safetensors"))
    got = load_file(str(runs[strategy] / "export" / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].shape == tensor.shape, name
        # Same estimate as REL for weights after 10 AdamW steps of lr 3e-3 (not a derived bound).
        assert torch.allclose(got[name], tensor, rtol=1e-3, atol=1e-5), name


def test_summary_records_strategy_throughput_and_memory(runs: dict[str, Path]) -> None:
    s = summary(runs["zero3"])
    assert s["status"] == "finished" and s["world_size"] == 2
    assert s["config"]["parallel"]["strategy"] == "zero3"
    thr = s["throughput"]
    assert thr["tokens_per_s"] == pytest.approx(thr["samples_per_s"] * 64)
    assert thr["model_flops_per_s_per_device"] > 0
    assert "mfu" in thr  # null on a CPU without train.peak_flops
    # 6 N per token counts every parameter; 0.9 allows those without matmul work (embeddings).
    assert s["model"]["train_flops_per_sample"] > 6 * s["model"]["parameters"] * 64 * 0.9
    per_rank = s["memory"]["per_rank"]
    assert len(per_rank) == 2 and all(r["peak_allocated_bytes"] is None for r in per_rank)


def test_zero3_holds_half_the_model_states_of_ddp(runs: dict[str, Path]) -> None:
    ddp = [r["model_states_bytes"] for r in summary(runs["ddp"])["memory"]["per_rank"]]
    zero3 = [r["model_states_bytes"] for r in summary(runs["zero3"])["memory"]["per_rank"]]
    for d, z in zip(ddp, zero3, strict=True):
        # Two shards of every parameter and its AdamW state; uneven dim-0 splits leave < 5% over.
        assert z / d == pytest.approx(0.5, abs=0.05)
    # zero1 shards only the optimizer state: params + grads stay whole on each rank.
    z1 = summary(runs["zero1"])["memory"]["per_rank"]
    dd = summary(runs["ddp"])["memory"]["per_rank"]
    assert z1[0]["params_bytes"] == dd[0]["params_bytes"]
    # The shards add up to the whole; rel 0.01 allows the padding of uneven shards.
    assert sum(r["optimizer_bytes"] for r in z1) == pytest.approx(
        dd[0]["optimizer_bytes"], rel=0.01
    )


@pytest.mark.parametrize("strategy", ["zero2", "zero3", "tp", "ddp"])
def test_uneven_eval_shards_finish_with_the_one_process_result(
    runs: dict[str, Path], strategy: str
) -> None:
    """Before padding, rank 0 ran 2 eval batches and rank 1 one: under FSDP rank 0's second
    forward waited for an all-gather rank 1 never joined. Now both run 2 (one masked)."""
    want, got = summary(runs["single"])["final"], summary(runs[strategy])["final"]
    assert got["val_samples"] == want["val_samples"] == 33
    # ddp/zero: 17 windows per rank in batches of 16; tp: 33 windows in batches of 32.
    assert got["val_batches_per_rank"] == 2
    # fp32 sums of the same 33 per-window losses in another order and grouping (1e-4 relative
    # as for the training losses above).
    assert got["val_loss"] == pytest.approx(want["val_loss"], rel=REL)
    # Top-1 of 33 x 64 = 2112 predicted tokens: the same reordering may flip a near-tie or two.
    assert got["val_accuracy"] == pytest.approx(want["val_accuracy"], abs=2 / 2112)


def test_zero3_checkpoint_resumes_under_ddp(runs: dict[str, Path], tmp_path: Path) -> None:
    ckpt = runs["zero3"] / "checkpoints" / "step-5"
    train(runs["config"], tmp_path / "ddp", 2, "parallel.strategy=ddp", resume=str(ckpt))
    want, got = losses(runs["zero3"]), losses(tmp_path / "ddp")
    assert sorted(got) == [6, 7, 8, 9, 10]
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=REL)


def test_zero3_checkpoint_resumes_on_one_rank(runs: dict[str, Path], tmp_path: Path) -> None:
    """The 2-rank zero3 checkpoint of step 5 continues on one rank with the same global batch
    (16): the same samples in each step (elastic data position), so the losses of steps 6-10
    are the 2-rank run's own, within the reduction-order estimate REL."""
    ckpt = runs["zero3"] / "checkpoints" / "step-5"
    train(runs["config"], tmp_path / "one", 1, "data.batch_size=16", resume=str(ckpt))
    assert summary(tmp_path / "one")["steps"] == 10
    want, got = losses(runs["zero3"]), losses(tmp_path / "one")
    assert sorted(got) == [6, 7, 8, 9, 10]
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=REL), step


def test_zero1_checkpoint_resumes_under_zero3(runs: dict[str, Path], tmp_path: Path) -> None:
    ckpt = runs["zero1"] / "checkpoints" / "step-5"
    train(runs["config"], tmp_path / "z3", 2, "parallel.strategy=zero3", resume=str(ckpt))
    want, got = losses(runs["zero1"]), losses(tmp_path / "z3")
    for step in (6, 7, 8, 9, 10):
        assert got[step] == pytest.approx(want[step], rel=REL)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_rank_checks_its_traced_step_peak(runs: dict[str, Path], strategy: str) -> None:
    """Each rank of a 2-process run traced its third step's live tensor bytes as it ran
    (hpcml.train.peaktrace), and the run's prediction block compares the peak rank by rank."""
    s = summary(runs[strategy])
    rows = {r["quantity"]: r for r in s["prediction"]["rows"]}
    per_rank = s["memory"]["per_rank"]
    for rank, r in enumerate(per_rank):
        assert r["traced_peak_step"] == 3
        assert sum(r["traced_at_peak"].values()) == r["traced_peak_bytes"]
        assert rows[f"peak_bytes rank {rank}"]["measured"] == r["traced_peak_bytes"]
    assert rows["peak_bytes"]["measured"] == max(r["traced_peak_bytes"] for r in per_rank)
