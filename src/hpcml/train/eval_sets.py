"""Named evaluation sets (`train.eval_sets`) and the forgetting they measure (continual learning).

Each named set is the validation split of another data path of the run's `data.source` (the
old task's tokens, say, beside the new task's that the run trains on). Every evaluation scores
each set on every data-parallel rank's share (`hpcml.train.evaluation.evaluate_model`) and adds
`NAME/val_loss` and `NAME/val_accuracy` to the eval record. A fresh run also scores every set
once before its first step; the checkpoints keep those scores, so a resumed run compares with
the same starting point. The summary's `eval_sets` block gives, per set, the scores before and
after and the forgetting: the rise of the loss and the fall of the accuracy (negative when the
set improved).
"""

from __future__ import annotations

import re
from typing import Any

from hpcml.config import RunConfig
from hpcml.data.loader import eval_loader, shard_for_eval
from hpcml.data.sources import load_source
from hpcml.data.splits import Splits
from hpcml.errors import ConfigError, HpcmlError
from hpcml.train.evaluation import evaluate_model

STATE_KEY = "eval_sets_before"
METRICS = ("val_loss", "val_accuracy")
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def load(cfg: RunConfig, main: Splits) -> dict[str, Splits]:
    """The validation splits of `train.eval_sets`, refused in one sentence when a name is not
    usable in a metric name or a set's samples do not fit the model the main data sizes."""
    sets: dict[str, Splits] = {}
    for name, path in (cfg.train.eval_sets or {}).items():
        if not _NAME.match(name):
            raise ConfigError(
                f"train.eval_sets name {name!r} cannot name a metric; use 1 to 64 letters, "
                "digits, '_', '.' or '-' (e.g. old, new)."
            )
        data = cfg.data.model_copy(update={"path": path, "mix": None, "limit_train": None})
        try:
            splits = load_source(data)
        except HpcmlError as exc:  # its sentence says data.path: say which setting it was
            raise type(exc)(f"train.eval_sets.{name}: {exc.message}") from None
        have = (splits.input_shape, splits.input_dtype, splits.target_shape, splits.num_classes)
        want = (main.input_shape, main.input_dtype, main.target_shape, main.num_classes)
        if have != want:
            raise ConfigError(
                f"train.eval_sets.{name} ({path!r}) holds samples of shape {list(have[0])} "
                f"({have[1]}, {have[3]} classes) but data.path's are {list(want[0])} ({want[1]}, "
                f"{want[3]} classes); name a set prepared like the training data."
            )
        sets[name] = splits
    return sets


class EvalSets:
    """The loaders of the named sets on this rank, and the scores before training."""

    def __init__(
        self, sets: dict[str, Splits], dp_rank: int, dp_size: int, batch: int, pin: bool
    ) -> None:
        self.loaders = {
            name: eval_loader(shard_for_eval(s.val, dp_rank, dp_size), batch, pin)
            for name, s in sets.items()
        }
        self.before: dict[str, dict[str, float]] = {}

    def __bool__(self) -> bool:
        return bool(self.loaders)

    def evaluate(self, trainer: Any) -> dict[str, float]:
        """`NAME/val_loss` and `NAME/val_accuracy` of every set (a collective: every rank)."""
        out: dict[str, float] = {}
        for name, loader in self.loaders.items():
            scores = evaluate_model(
                trainer.model,
                loader,
                trainer.rt,
                trainer.precision,
                trainer.cfg.train.channels_last,
                trainer.device_normalize,
            )
            out.update({f"{name}/{m}": float(scores[m]) for m in METRICS})
        return out

    def start(self, trainer: Any, saved: dict[str, Any] | None) -> None:
        """The scores before training: the checkpoint's on a resume that has them, else the
        model's now (step 0 for a fresh run; the resume step when the checkpoint had none)."""
        if not self:
            return
        kept = (saved or {}).get(STATE_KEY) or {}
        if set(kept) >= set(self.loaders):
            self.before = {n: kept[n] for n in self.loaders}
            return
        scores = self.evaluate(trainer)
        self.before = {
            n: {"step": trainer.step, **{m: scores[f"{n}/{m}"] for m in METRICS}}
            for n in self.loaders
        }

    def checkpoint_fields(self) -> dict[str, Any]:
        return {STATE_KEY: self.before} if self else {}

    def summary_block(self, last_eval: dict[str, float] | None, step: int) -> dict[str, Any]:
        """Per set: before, after (the last evaluation) and forgetting."""
        if not self or not last_eval:
            return {}
        block: dict[str, Any] = {}
        for name, before in self.before.items():
            after = {"step": step, **{m: last_eval[f"{name}/{m}"] for m in METRICS}}
            block[name] = {
                "before": before,
                "after": after,
                "forgetting": {
                    "val_loss_increase": after["val_loss"] - before["val_loss"],
                    "val_accuracy_drop": before["val_accuracy"] - after["val_accuracy"],
                },
            }
        return block
