"""A resume applies or refuses every changed hyperparameter, and leaves a finished run alone.

One 2-step mlp run (module fixture) is copied per test and resumed with another config:
- applied: lr, betas, eps, weight decay and the batch size reach the optimizer's param groups,
  the scheduler's base lrs, the step records and the data position of the next checkpoint
  (before, the checkpoint's lr and betas silently won while config.yaml recorded the new ones,
  and a new batch size restored the loader's position counted in old batches);
- refused: changes a checkpoint cannot express end in one sentence, exit 2, the folder
  byte-identical;
- `--resume auto` at train.max_steps of a finished run says so and changes no byte (before, it
  rewrote summary.json, the eval record and the export).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.conftest import run_hpcml

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CONFIG = """
model: {name: mlp, args: {hidden: 32}}
data: {source: synthetic, synthetic_samples: 256, synthetic_shape: [3, 8, 8], batch_size: 8}
optim: {name: adamw, lr: 0.01, weight_decay: 0.01, schedule: constant}
train: {max_steps: 2, checkpoint_every: 2, eval_every: 0, log_every: 1}
"""


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("resume_changes")
    config = root / "mlp.yaml"
    config.write_text(CONFIG)
    run = root / "base"
    run_hpcml("train", str(config), "--run-dir", str(run), "--quiet")
    return config, run


def copy(base: tuple[Path, Path], tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(base[1], run)
    return run


def digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def resume(base: tuple[Path, Path], run: Path, *overrides: str, check: bool = True) -> Any:
    return run_hpcml(
        "train",
        str(base[0]),
        *overrides,
        "--run-dir",
        str(run),
        "--resume",
        "auto",
        "--quiet",
        check=check,
    )


def saved_optimizer_groups(checkpoint: Path) -> list[dict]:
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    return list(
        _load_state_dict_from_keys({"optim"}, checkpoint_id=str(checkpoint))["optim"][
            "param_groups"
        ]
    )


def test_changed_hyperparameters_are_applied(base: tuple[Path, Path], tmp_path: Path) -> None:
    run = copy(base, tmp_path)
    changes = ["optim.lr=0.001", "optim.betas=[0.8,0.99]", "optim.eps=1e-6"]
    changes += ["optim.weight_decay=0.05", "data.batch_size=4"]
    out = resume(base, run, "train.max_steps=4", *changes)
    assert "applied on resume: optim.lr 0.01 -> 0.001, optim.betas [0.9, 0.999] -> [0.8, 0.99]" in (
        out.stderr
    )
    recs = [json.loads(line) for line in (run / "run.jsonl").read_text().splitlines()]
    assert [(r["step"], r["lr"]) for r in recs if r["kind"] == "step"] == [
        (1, 0.01),
        (2, 0.01),
        (3, 0.001),
        (4, 0.001),
    ]
    (record,) = [r for r in recs if r["kind"] == "resume"]
    assert record["applied"]["optim.eps"] == [1e-8, 1e-6]
    decayed, exempt = saved_optimizer_groups(run / "checkpoints" / "step-4")
    for group in (decayed, exempt):
        assert (group["lr"], group["initial_lr"]) == (0.001, 0.001)
        assert (tuple(group["betas"]), group["eps"]) == ((0.8, 0.99), 1e-6)
    assert (decayed["weight_decay"], exempt["weight_decay"]) == (0.05, 0.0)
    trainer = torch.load(run / "checkpoints" / "step-4" / "trainer.pt", weights_only=True)
    assert trainer["scheduler"]["base_lrs"] == [0.001, 0.001]
    # 2 steps of 8 samples, then 2 of 4: the next unseen sample, not 2 old batches of 4.
    assert trainer["data_position"]["samples"] == 2 * 8 + 2 * 4


@pytest.mark.parametrize(
    "change,key",
    [("train.seed=3", "train.seed"), ("optim.weight_decay=0", "optim.weight_decay")],
)
def test_a_change_a_resume_cannot_apply_is_refused(
    base: tuple[Path, Path], tmp_path: Path, change: str, key: str
) -> None:
    run = copy(base, tmp_path)
    before = digest(run)
    out = resume(base, run, "train.max_steps=4", change, check=False)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {key} is "), out.stderr
    assert digest(run) == before


def test_resume_auto_on_a_finished_run_changes_nothing(
    base: tuple[Path, Path], tmp_path: Path
) -> None:
    run = copy(base, tmp_path)
    before = digest(run)
    out = resume(base, run)
    assert f"run folder {run} has finished" in out.stderr
    assert digest(run) == before
