"""Daly's interval from what a run measured (issue 29): the checkpoint cost is the time until
a save is durable (an async save's background write included; before, the short stall of an
async save alone), and the restart cost is the checkpoint load a resume measured (before, a
60 s constant)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.conftest import run_hpcml, summary

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CONFIG = """
model: {name: mlp, args: {hidden: 16}}
data: {source: synthetic, synthetic_samples: 128, synthetic_shape: [3, 4, 4], batch_size: 8}
optim: {schedule: constant}
train: {max_steps: 2, checkpoint_every: 1, checkpoint_async: true, eval_every: 0, log_every: 1}
"""


def test_checkpoint_interval_uses_the_durable_time_and_the_measured_load(tmp_path: Path) -> None:
    config = tmp_path / "mlp.yaml"
    config.write_text(CONFIG)
    run = tmp_path / "run"
    run_hpcml("train", str(config), "--run-dir", str(run), "--quiet")
    run_hpcml("train", str(config), "train.max_steps=4", "--run-dir", str(run), "--resume", "auto",
              "--quiet")  # fmt: skip
    measured = summary(run)["fault"]["checkpoints"]
    assert measured["background"] and measured["total_s_median"] > measured["stall_s_median"]
    assert measured["load_s"] > 0
    out = run_hpcml("launch", "checkpoint-interval", str(run), "--mtbf", "24h", "--json")
    advice = json.loads(out.stdout)
    assert advice["checkpoint_s"] == measured["total_s_median"]
    assert advice["restart_s"] == measured["load_s"]
    assert advice["restart_s_source"] == f"load measured in {run}"
