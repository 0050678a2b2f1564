"""One non-finite decision per step on every rank, whatever holds the bad gradient.

`inf_row_gpt` (tests/integration/worker_models.py) is gpt-tiny whose head gradient gets +Inf in
one vocabulary row at step 3; the loss stays finite. Sharded by rows (zero3's dim-0 shards,
tp's vocabulary split) only one rank holds that row. Every rank must still skip step 3 (the
decision comes from the global gradient norm, reduced on the device), so the 2-process runs
keep the one-process losses, and the skip is counted in the summary and the step record.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
from tests.conftest import hpcml_proc, summary
from tests.conftest import step_losses as losses
from tests.integration.worker_models import INF_STEP

from hpcml.data.sources.tokens import prepare_pystdlib

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 5
# Sharded runs average fp32 gradients in another order than one process (~6e-8 relative per
# step): after 5 AdamW steps of gpt-tiny the measured gap is below 1e-7; 1e-5 leaves room for
# that growth and is 10000x below the 0.1 a one-sided skip made (issue 29).
REL = 1e-5

CONFIG = """
model: {{name: "tests.integration.worker_models:inf_row_gpt"}}
data: {{source: tokens, path: {corpus}, seq_len: 64, batch_size: 8, eval_windows: 4}}
optim: {{name: adamw, lr: 0.003}}
train: {{max_steps: {steps}, eval_every: 0, checkpoint_every: 0, log_every: 2}}
precision: fp32
"""


def train(
    config: Path, run_dir: Path, nproc: int, *overrides: str, code: int = 0
) -> subprocess.CompletedProcess[str]:
    # Forked from the pre-imported server (conftest); with --nproc, torchrun's agent runs in
    # that process and forks the workers (hpcml.launch.forked_workers): no new interpreter.
    args = ["train", str(config), *overrides, "--run-dir", str(run_dir), "--quiet"]
    out = hpcml_proc(args + (["--nproc", str(nproc)] if nproc > 1 else []), timeout=300)
    assert out.returncode == code, f"{' '.join(args)}:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("nonfinite")
    corpus = root / "corpus"
    prepare_pystdlib(corpus, val_fraction=0.2, max_bytes=200_000)
    path = root / "inf.yaml"
    path.write_text(CONFIG.format(corpus=corpus, steps=STEPS))
    return path


@pytest.fixture(scope="module")
def runs(config: Path) -> dict[str, Path]:
    root = config.parent
    out = {"single": root / "single", "zero3": root / "zero3", "tp": root / "tp"}
    train(config, out["single"], 1, "data.batch_size=16")  # the 2-rank global batch
    train(config, out["zero3"], 2, "parallel.strategy=zero3")
    train(config, out["tp"], 2, "parallel.tp=2", "data.batch_size=16")
    return out


def step_records(run_dir: Path) -> dict[int, dict]:
    recs = [json.loads(line) for line in (run_dir / "run.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in recs if r.get("kind") == "step"}


@pytest.mark.parametrize("layout", ["single", "zero3", "tp"])
def test_the_step_with_an_inf_shard_is_skipped_and_counted(
    runs: dict[str, Path], layout: str
) -> None:
    fault = summary(runs[layout])["fault"]
    assert (fault["skipped_steps"], fault["nonfinite_steps"]) == (1, 1), fault
    recs = step_records(runs[layout])
    assert sorted(recs) == list(range(1, STEPS + 1))
    assert [s for s, r in recs.items() if r["skipped"]] == [INF_STEP]
    assert math.isinf(recs[INF_STEP]["grad_norm"])  # the record says why
    assert all(r["grad_norm"] > 0 for s, r in recs.items() if s != INF_STEP)


@pytest.mark.parametrize("layout", ["zero3", "tp"])
def test_two_ranks_keep_the_one_process_losses(runs: dict[str, Path], layout: str) -> None:
    want, got = losses(runs["single"]), losses(runs[layout])
    for step in range(1, STEPS + 1):
        assert got[step] == pytest.approx(want[step], rel=REL), f"{layout} step {step}"


def test_a_finite_loss_with_an_inf_gradient_stops_at_that_step(config: Path) -> None:
    # The host-side guard (nan_policy stop) judges the gradient norm too: before, it saw a
    # finite loss, applied the Inf update and stopped a step later on the NaN weights' loss.
    run = config.parent / "stop"
    out = train(config, run, 1, "fault.nan_policy=stop", code=1)
    assert f"the loss at step {INF_STEP} was finite" in out.stderr
    assert "gradient norm was inf" in out.stderr
    assert summary(run)["status"] == "failed"
