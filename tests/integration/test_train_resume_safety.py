"""Resume is safe and says what it does: a checkpoint that does not fit the model or optimizer,
or a changed LR horizon, ends with one sentence (exit 2) and leaves every file of the run folder
byte-identical; `--resume auto` without a checkpoint says it starts from step 0 and the run log
holds each step once."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
from tests.conftest import run_hpcml, step_losses, summary

pytestmark = pytest.mark.slow

CONFIG = "examples/digits_cnn.yaml"
FAST = [
    "model.name=mlp",
    "model.args={hidden: 32}",
    "train.max_steps=4",
    "train.eval_every=0",
    "data.batch_size=16",
    "train.log_every=2",
    "optim.warmup_steps=0",
]


def tree_sha256(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def refused(proc, *words: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    for w in words:
        assert w in errors[0], (w, errors[0])
    return errors[0]


def test_mismatched_checkpoint_and_lr_horizon_are_refused_untouched(tmp_path: Path):
    run = tmp_path / "run"
    run_hpcml("train", CONFIG, *FAST, "--run-dir", str(run), "--quiet")
    before = tree_sha256(run)
    assert summary(run)["status"] == "finished"

    # Another model: the first parameter the new model needs is not in the checkpoint.
    proc = run_hpcml(
        "train",
        CONFIG,
        *FAST,
        "model.name=simple_cnn",
        "model.args={}",
        "--run-dir",
        str(run),
        "--resume",
        "auto",
        check=False,
    )
    refused(proc, "model.name=mlp", "model.name=simple_cnn", "'model.")
    assert tree_sha256(run) == before

    # Another optimizer: SGD's momentum buffer is not in an AdamW checkpoint.
    proc = run_hpcml(
        "train",
        CONFIG,
        *FAST,
        "optim.name=sgd",
        "--run-dir",
        str(run),
        "--resume",
        "auto",
        check=False,
    )
    refused(proc, "momentum_buffer", "optim.name=adamw", "optim.name=sgd")
    assert tree_sha256(run) == before

    # The same mismatch found inside torchrun workers: one sentence, exit 2, untouched.
    proc = run_hpcml(
        "train",
        CONFIG,
        *FAST,
        "model.args={hidden: 48}",
        "--nproc",
        "2",
        "--run-dir",
        str(run),
        "--resume",
        "auto",
        check=False,
    )
    refused(proc, "shape [32, 3072] there and [48, 3072] here", "model.args")
    assert "ChildFailedError" not in proc.stderr
    assert tree_sha256(run) == before

    # A longer run would bend the LR schedule silently: refused, naming optim.decay_steps.
    proc = run_hpcml(
        "train",
        CONFIG,
        *FAST,
        "train.max_steps=6",
        "--run-dir",
        str(run),
        "--resume",
        "auto",
        check=False,
    )
    refused(proc, "over 4 steps", "optim.decay_steps=4")
    assert tree_sha256(run) == before

    # Stretched explicitly: honoured from the first resumed step (cosine over 8, no warmup).
    proc = run_hpcml(
        "train",
        CONFIG,
        *FAST,
        "train.max_steps=6",
        "optim.decay_steps=8",
        "--run-dir",
        str(run),
        "--resume",
        "auto",
        "--quiet",
    )
    base = summary(run)["config"]["optim"]["lr"]
    lrs = {
        json.loads(x)["step"]: json.loads(x)["lr"]
        for x in (run / "run.jsonl").read_text().splitlines()
        if json.loads(x)["kind"] == "step"
    }
    assert sorted(lrs) == [1, 2, 3, 4, 5, 6]
    # The record of step s carries the lr used for it: s - 1 scheduler steps done.
    for s in (5, 6):
        want = base * 0.5 * (1 + math.cos(math.pi * (s - 1) / 8))
        assert lrs[s] == pytest.approx(want, rel=1e-12), (s, lrs[s], want)


def test_resume_auto_without_checkpoint_starts_at_zero_once(tmp_path: Path):
    run = tmp_path / "run"
    run_hpcml("train", CONFIG, *FAST, "--run-dir", str(run), "--quiet")
    # As if the run had crashed before its first checkpoint: a log, no checkpoint, no summary.
    for p in sorted((run / "checkpoints").rglob("*"), reverse=True):
        p.unlink() if p.is_file() else p.rmdir()
    (run / "checkpoints").rmdir()
    (run / "summary.json").unlink()
    proc = run_hpcml("train", CONFIG, *FAST, "--run-dir", str(run), "--resume", "auto", "--quiet")
    said = [line for line in proc.stderr.splitlines() if "starting from step 0" in line]
    assert len(said) == 1 and "no complete checkpoint" in said[0], proc.stderr
    steps = [
        json.loads(x)["step"]
        for x in (run / "run.jsonl").read_text().splitlines()
        if json.loads(x)["kind"] == "step"
    ]
    assert steps == [1, 2, 3, 4]
    assert sorted(step_losses(run)) == [1, 2, 3, 4]
