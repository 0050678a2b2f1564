"""The Trainer's extension points change behaviour: `train.loss` swaps the loss, a hook's
`forward_context` wraps every micro-batch's forward, and `on_end` adds to the summary before
summary.json is written. One process, in this test's process (no process group)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.conftest import step_losses

from hpcml.config import load_config
from hpcml.train.hooks import Hook, Hooks
from hpcml.train.trainer import Trainer

BASE = [
    "model.name=mlp",
    "model.args={hidden: 16}",
    "data.batch_size=16",
    "train.eval_every=0",
    "train.log_every=1",
    "fault.watchdog_s=0",
]


class Probe(Hook):
    rank_zero_only = False

    def __init__(self) -> None:
        self.forwards = 0

    @contextlib.contextmanager
    def _count(self) -> Iterator[None]:
        self.forwards += 1
        yield

    def forward_context(self, trainer: Any) -> Any:
        return self._count()

    def on_end(self, summary: dict[str, Any]) -> None:
        summary["probe"] = {"forwards": self.forwards}


def _fit(run: Path, *overrides: str, hooks: Hooks | None = None) -> dict[str, Any]:
    cfg = load_config("examples/digits_cnn.yaml", [*BASE, *overrides])
    return Trainer(cfg, run_dir=run, quiet=True, hooks=hooks or Hooks()).fit()


def test_custom_loss_hooks_and_summary(tmp_path: Path) -> None:
    _fit(tmp_path / "ce", "train.max_steps=1")
    _fit(
        tmp_path / "x2",
        "train.max_steps=1",
        "train.loss=tests.integration.worker_models:doubled_cross_entropy",
    )
    # Same seed, data and initial weights: the first loss is exactly twice cross-entropy's.
    assert step_losses(tmp_path / "x2")[1] == 2.0 * step_losses(tmp_path / "ce")[1]

    probe = Probe()
    _fit(tmp_path / "probe", "train.max_steps=3", "train.grad_accum=2", hooks=Hooks([probe]))
    assert probe.forwards == 3 * 2  # every micro-batch's forward, none of evaluation's
    written = json.loads((tmp_path / "probe" / "summary.json").read_text())
    assert written["probe"] == {"forwards": 6}
