"""The training loop's tracking hook: hands the engine's events to the tracker of `tracking.*`.

Rank 0 only (the engine calls hooks there). The MLflow run is resumed exactly when training
resumes from a checkpoint, so `--overwrite` starts a fresh MLflow run in the same folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpcml.config import TrackingConfig, flatten
from hpcml.track.mlflow import MlflowTracker, NullTracker, make_tracker
from hpcml.track.provenance import to_tags
from hpcml.train.hooks import Hook


class TrackingHook(Hook):
    def __init__(self, cfg: TrackingConfig) -> None:
        self.cfg = cfg
        self.tracker: MlflowTracker | NullTracker = NullTracker()
        self.run_dir: Path | None = None

    def on_start(self, ctx: dict[str, Any]) -> None:
        self.run_dir = Path(ctx["run_dir"])
        self.tracker = make_tracker(self.cfg, self.run_dir)
        tags = to_tags(ctx.get("provenance") or {})
        tags["hpcml.world_size"] = str(ctx["rt"].world_size)
        self.tracker.start(flatten(ctx["cfg"]), tags, resume=ctx.get("resumed_from") is not None)

    def on_steps(self, records: list[dict[str, Any]]) -> None:
        self.tracker.log_steps(records)

    def on_eval(self, record: dict[str, Any]) -> None:
        self.tracker.log_eval(record)

    def on_end(self, summary: dict[str, Any]) -> None:
        assert self.run_dir is not None
        self.tracker.finish(summary, "finished", self.run_dir)

    def on_fail(self, status: str, exc: BaseException) -> None:
        if self.run_dir is not None:
            error = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            self.tracker.finish(error, status, self.run_dir)
