"""Kept for callers of `hpcml.train.engine.run`: the loop lives in `hpcml.train.trainer`."""

from __future__ import annotations

from hpcml.train.trainer import Trainer, run

__all__ = ["Trainer", "run"]
