"""`train.global_batch` (issue 10, item 5): grad_accum is derived from it and the number of
data-parallel processes, so a run checkpointed on 2 processes and resumed on 1 keeps the same
optimization: the same 32 samples per step (the elastic data position continues at the next
unseen global sample) and the same update. Without it, the resume says in one line what the
global batch becomes (issue 29).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from tests.conftest import hpcml_env, run_hpcml, step_losses, summary

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# mlp: no dropout, no BatchNorm, so no per-rank state makes 2 processes differ from 1.
CONFIG = """
model: {name: mlp, args: {hidden: 64}}
data: {source: synthetic, synthetic_samples: 512, synthetic_shape: [3, 8, 8], batch_size: 8}
optim: {name: adamw, lr: 0.01}
train: {max_steps: 6, checkpoint_every: 3, eval_every: 0, log_every: 1, global_batch: 32,
        deterministic: true}
"""


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The config and a run of it on 2 processes."""
    root = tmp_path_factory.mktemp("global_batch")
    config = root / "mlp.yaml"
    config.write_text(CONFIG)
    run = root / "two"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += ["-m", "hpcml", "train", str(config), "--run-dir", str(run), "--quiet"]
    out = subprocess.run(cmd, env=hpcml_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return config, run


def test_resume_from_2_to_1_process_keeps_the_optimization(
    two: tuple[Path, Path], tmp_path: Path
) -> None:
    config, two_run = two
    assert summary(two_run)["global_batch"] == 32  # 8 x 2 micro-batches x 2 processes
    one = tmp_path / "one"
    step3 = two_run / "checkpoints" / "step-3"
    out = run_hpcml("train", str(config), "--run-dir", str(one), "--resume", str(step3), "--quiet")
    assert "global batch becomes" not in out.stderr  # train.global_batch keeps it
    assert summary(one)["global_batch"] == 32  # 8 x 4 micro-batches x 1 process
    want, got = step_losses(two_run), step_losses(one)
    assert sorted(got) == [4, 5, 6]
    for step in got:
        # The same samples and weights; only the order of fp32 sums differs (2 ranks' means
        # averaged vs 4 micro-batches summed): ~1e-7 relative per step, grown by 3 AdamW steps.
        assert got[step] == pytest.approx(want[step], abs=1e-5), (step, got, want)


def test_a_world_size_change_without_global_batch_says_what_it_becomes(
    two: tuple[Path, Path], tmp_path: Path
) -> None:
    config, two_run = two
    one, step3 = tmp_path / "one", two_run / "checkpoints" / "step-3"
    args = ["train", str(config), "train.global_batch=null", "--run-dir", str(one)]
    out = run_hpcml(*args, "--resume", str(step3), "--quiet")
    assert (
        "resuming at step 3: the global batch becomes 8 (data.batch_size 8 x train.grad_accum "
        "1 x 1 data-parallel process(es)); the checkpoint was trained with 32 on 2 process(es); "
        "set train.global_batch=32 to keep it."
    ) in out.stderr
    assert summary(one)["global_batch"] == 8


def test_global_batch_not_divisible_is_one_sentence(tmp_path: Path) -> None:
    """With --nproc 2 the parent refuses before torchrun starts (no worker, no folder)."""
    nproc = "2"
    config = tmp_path / "mlp.yaml"
    config.write_text(CONFIG)
    run = tmp_path / "r"
    args = ["train", str(config), "train.global_batch=36", "--run-dir", str(run), "--nproc", nproc]
    proc = run_hpcml(*args, check=False)
    assert proc.returncode == 2, proc.stderr
    want = f"train.global_batch 36 is not a multiple of data.batch_size 8 x {nproc} data-parallel"
    assert want in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not run.exists()
