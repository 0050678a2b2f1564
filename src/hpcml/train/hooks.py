"""Named extension points of the training loop, called on rank 0 only.

Tracking (MLflow) and other observers subclass `Hook`; the engine calls `Hooks`, which fans
out to each and never lets an observer's failure stop training silently.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any


class Hook:
    def on_start(self, ctx: dict[str, Any]) -> None: ...
    def on_steps(self, records: list[dict[str, Any]]) -> None: ...
    def on_eval(self, record: dict[str, Any]) -> None: ...
    def on_checkpoint(self, path: Path, step: int) -> None: ...
    def on_end(self, summary: dict[str, Any]) -> None: ...
    def on_fail(self, status: str, exc: BaseException) -> None: ...


class Hooks:
    def __init__(self, hooks: list[Hook] | None = None) -> None:
        self.hooks = list(hooks or [])

    def start(self, ctx: dict[str, Any]) -> None:
        for h in self.hooks:
            h.on_start(ctx)

    def steps(self, records: list[dict[str, Any]]) -> None:
        for h in self.hooks:
            h.on_steps(records)

    def eval(self, record: dict[str, Any]) -> None:
        for h in self.hooks:
            h.on_eval(record)

    def checkpoint(self, path: Path, step: int) -> None:
        for h in self.hooks:
            h.on_checkpoint(path, step)

    def end(self, summary: dict[str, Any]) -> None:
        for h in self.hooks:
            h.on_end(summary)

    def fail(self, status: str, exc: BaseException) -> None:
        for h in self.hooks:
            # The original failure is what matters; an observer's own error must not hide it.
            with contextlib.suppress(Exception):
                h.on_fail(status, exc)
