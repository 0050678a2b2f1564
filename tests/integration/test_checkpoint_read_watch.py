"""A checkpoint read that hangs is watched like a save (issue 29): a resume whose read stalls
(a hung filesystem, injected into the `read` phase) ends after `fault.checkpoint_timeout_s`
with a sentence naming the rank and the phase, exit 1, and writes nothing into the run folder.
Before, the watchdog started only after the resume's load, so the read hung past any timeout."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from tests.conftest import hpcml_env, run_hpcml

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CONFIG = """
model: {name: mlp, args: {hidden: 16}}
data: {source: synthetic, synthetic_samples: 128, synthetic_shape: [3, 4, 4], batch_size: 8}
optim: {schedule: constant}
train: {max_steps: 2, checkpoint_every: 2, eval_every: 0, log_every: 1}
fault: {checkpoint_timeout_s: 2}
"""


def digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_a_resume_whose_read_hangs_ends_after_the_checkpoint_timeout(tmp_path: Path) -> None:
    config = tmp_path / "mlp.yaml"
    config.write_text(CONFIG)
    run = tmp_path / "run"
    run_hpcml("train", str(config), "--run-dir", str(run), "--quiet")
    before = digest(run)
    stall = {"ckpt_stall": {"phase": "read", "seconds": 600}}
    # 120 s for start-up on a loaded machine plus the 2 s timeout; a hang runs into it.
    proc = run_hpcml(
        "train", str(config), "train.max_steps=4", "--run-dir", str(run), "--resume", "auto",
        "--quiet", check=False, timeout=120,
        env=hpcml_env(HPCML_FAULT_INJECT=json.dumps(stall)),
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "rank 0 stalled in the read phase of the checkpoint of step 2" in proc.stderr
    assert "fault.checkpoint_timeout_s=2" in proc.stderr
    assert digest(run) == before  # nothing written: the run had not started
