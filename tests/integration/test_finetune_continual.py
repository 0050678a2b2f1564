"""Continual learning (issue 34): a gpt trained on an old task (byte tokens of Python's stdlib),
registered in a real MLflow registry (SQLite), fine-tuned with LoRA from `models:/old@production`
on a new task (seeded random letters) while `train.eval_sets` scores both; the summary's
forgetting is the old-task loss after minus before, each equal to an independent evaluation of
the export it belongs to. Also the QLoRA-style int8 base (`finetune.base_dtype: int8`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tests.conftest import summary

from hpcml.config import load_config
from hpcml.data.sources import load_source
from hpcml.data.sources.tokens import prepare_pystdlib
from hpcml.errors import ConfigError, DataError
from hpcml.models.export import load_export
from hpcml.track.registry import RegistryError
from hpcml.train.hooks import Hooks
from hpcml.train.trainer import Trainer

pytestmark = [pytest.mark.timeout(300)]

OLD = """
model: {{name: gpt-tiny, args: {{n_layer: 1, d_model: 32, n_head: 2}}}}
data: {{source: tokens, path: {old}, seq_len: 32, batch_size: 8, eval_windows: 16}}
optim: {{name: adamw, lr: 0.01, schedule: constant}}
train: {{max_steps: 30, eval_every: 0, log_every: 10, seed: 1}}
"""
NEW = """
model: {{name: gpt-tiny, args: {{n_layer: 1, d_model: 32, n_head: 2}}, init_from: {base}}}
data: {{source: tokens, path: {new}, seq_len: 32, batch_size: 8, eval_windows: 16}}
optim: {{name: adamw, lr: 0.05, schedule: constant}}
train: {{max_steps: 6, eval_every: 3, checkpoint_every: 3, log_every: 1, seed: 2,
         eval_sets: {{old: {old}, new: {new}}}}}
tracking: {{uri: {store}}}
finetune: {{method: lora, r: 8, alpha: 32}}
"""


def new_task(out: Path, seed: int, vocab: int = 256) -> None:
    """Byte tokens of seeded random lowercase letters: nothing like Python source."""
    rng = np.random.default_rng(seed)
    out.mkdir(parents=True)
    for name, n in (("train.bin", 20_000), ("val.bin", 4_000)):
        (out / name).write_bytes(rng.integers(97, 123, n).astype(np.uint16).tobytes())
    (out / "meta.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": vocab}))


def fit(config: Path, run: Path, *overrides: str, resume: str | None = None) -> dict[str, Any]:
    cfg = load_config(config, list(overrides))
    return Trainer(cfg, run_dir=run, resume=resume, quiet=True, hooks=Hooks()).fit()


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hpcml.track.registry import register_run

    root = tmp_path_factory.mktemp("continual")
    prepare_pystdlib(root / "old", val_fraction=0.2, max_bytes=100_000)
    new_task(root / "new", seed=7)
    store = f"sqlite:///{root / 'mlruns.db'}"
    (root / "old.yaml").write_text(OLD.format(old=root / "old"))
    fit(root / "old.yaml", root / "old_run")
    register_run(root / "old_run", "old", tracking_uri=store, alias="production")
    (root / "new.yaml").write_text(
        NEW.format(base="models:/old@production", old=root / "old", new=root / "new", store=store)
    )
    fit(root / "new.yaml", root / "new_run")
    return root


def old_val_loss(root: Path, export: Path) -> float:
    """The mean next-token loss of an export over the old task's validation windows, computed
    here with one batch of all of them (not the trainer's evaluation loop)."""
    cfg = load_config(root / "old.yaml", [])
    val = load_source(cfg.data).val
    x = torch.stack([val[i][0] for i in range(len(val))])  # type: ignore[arg-type]
    y = torch.stack([val[i][1] for i in range(len(val))])  # type: ignore[arg-type]
    model, _ = load_export(export)
    with torch.no_grad():
        logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item()


def test_forgetting_is_the_old_task_loss_before_and_after(tasks: Path) -> None:
    s = summary(tasks / "new_run")
    assert s["finetune"]["base_model"] == {"uri": "models:/old@production", "name": "old",
                                           "version": 1}
    old = s["eval_sets"]["old"]
    # One batch here vs the trainer's batches of 16 windows summed in float64: fp32 matmuls
    # blocked differently round differently, ~1e-7 relative; 1e-5 leaves room.
    assert old["before"]["step"] == 0
    assert old["before"]["val_loss"] == pytest.approx(
        old_val_loss(tasks, tasks / "old_run/export"), rel=1e-5
    )
    assert old["after"]["step"] == 6
    assert old["after"]["val_loss"] == pytest.approx(
        old_val_loss(tasks, tasks / "new_run/export"), rel=1e-5
    )
    rise = old["forgetting"]["val_loss_increase"]
    assert rise == old["after"]["val_loss"] - old["before"]["val_loss"]
    assert rise > 0.05  # six steps on random letters made the stdlib model worse at Python
    new = s["eval_sets"]["new"]["forgetting"]["val_loss_increase"]
    assert new < -0.05  # and better at the letters it trained on
    evals = [json.loads(line) for line in (tasks / "new_run/run.jsonl").read_text().splitlines()]
    evals = [r for r in evals if r.get("kind") == "eval"]
    assert [r["step"] for r in evals] == [3, 6]
    assert evals[-1]["old/val_loss"] == old["after"]["val_loss"]


def test_resume_keeps_the_scores_before_training(tasks: Path) -> None:
    """The scores before training come back from the checkpoint: a run resumed at step 3 has
    the uninterrupted run's `before` (step 0), not a score of the step-3 model."""
    again = tasks / "resumed"
    shutil.copytree(tasks / "new_run", again)
    shutil.rmtree(again / "checkpoints/step-6")
    fit(tasks / "new.yaml", again, resume="auto")
    want, got = summary(tasks / "new_run")["eval_sets"], summary(again)["eval_sets"]
    assert got["old"]["before"] == want["old"]["before"]
    assert got["old"]["after"]["val_loss"] == pytest.approx(want["old"]["after"]["val_loss"],
                                                            rel=1e-6)  # exact resume; AdamW fp32


@pytest.mark.parametrize(
    ("override", "error", "says"),
    [
        ("model.init_from=models:/old@nosuch", RegistryError, "has no alias 'nosuch'"),
        ("model.init_from=models:/missing@production", RegistryError, "missing"),
        ("train.eval_sets={'old task': x}", ConfigError, "cannot name a metric"),
        ("train.eval_sets={gone: /nonexistent/i34}", DataError, "eval_sets.gone: data.path"),
    ],
)
def test_bad_continual_config_is_one_sentence(
    tasks: Path, override: str, error: type[Exception], says: str
) -> None:
    from hpcml.train.validate import resolve

    cfg = load_config(tasks / "new.yaml", [override])
    with pytest.raises(error, match=says) as err:
        resolve(cfg, 1)
    assert "\n" not in str(err.value) and err.value.exit_code == 2  # type: ignore[attr-defined]


def test_an_eval_set_unlike_the_training_data_is_refused(tasks: Path) -> None:
    """A set whose tokens need another vocabulary than data.path's cannot be scored by this
    model: one sentence, naming the set, before anything runs."""
    from hpcml.train.validate import resolve

    new_task(tasks / "wide", seed=8, vocab=300)
    cfg = load_config(tasks / "new.yaml", [f"train.eval_sets={{wide: {tasks / 'wide'}}}"])
    with pytest.raises(ConfigError, match=r"train.eval_sets.wide .* 300 classes") as err:
        resolve(cfg, 1)
    assert "\n" not in str(err.value) and err.value.exit_code == 2
