"""Named extension points of the training loop.

Two kinds of hook method:
- observers (`on_start`, `on_steps`, `on_eval`, `on_checkpoint`, `on_end`, `on_fail`) see what
  happened; by default only rank 0 calls them (`rank_zero_only = True`). `on_end` receives the
  summary before it is written and may add to it. An observer's failure in `on_fail` never
  hides the original error.
- behaviour hooks, called on every rank whose hook has `rank_zero_only = False`, change what a
  step does: `forward_context` wraps each micro-batch's forward (and loss) in a context manager,
  `before_step` runs before the first micro-batch, `after_backward` returns a `StepDecision`
  (skip the update, roll back to a checkpoint, stop for preemption) that the Trainer applies.
  Every rank must return the same decision: decide from reduced values only.

Tracking (MLflow) is an observer; fault tolerance (`hpcml.train.fault.hook`) is a behaviour hook.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class StepDecision:
    """What the Trainer does with the step it just computed (the same on every rank)."""

    skip: bool = False
    rollback_to: Path | None = None
    preempt: bool = False
    interrupt: bool = False
    """Ctrl-C: every rank stops here without a checkpoint."""

    def merge(self, other: StepDecision | None) -> StepDecision:
        if other is None:
            return self
        return StepDecision(
            self.skip or other.skip,
            self.rollback_to or other.rollback_to,
            self.preempt or other.preempt,
            self.interrupt or other.interrupt,
        )


class Hook:
    rank_zero_only: bool = True
    """Observers run on rank 0 only; a behaviour hook sets this False to run on every rank."""

    def on_start(self, ctx: dict[str, Any]) -> None: ...
    def on_steps(self, records: list[dict[str, Any]]) -> None: ...
    def on_eval(self, record: dict[str, Any]) -> None: ...
    def on_checkpoint(self, path: Path, step: int) -> None: ...
    def on_end(self, summary: dict[str, Any]) -> None: ...
    def on_fail(self, status: str, exc: BaseException) -> None: ...

    def forward_context(self, trainer: Any) -> AbstractContextManager[Any] | None:
        return None

    def before_step(self, trainer: Any) -> None: ...

    def after_backward(
        self, trainer: Any, loss_sum: Any, data_wait_s: float
    ) -> StepDecision | None:
        return None


class Hooks:
    def __init__(self, hooks: list[Hook] | None = None) -> None:
        self.hooks = list(hooks or [])
        self.is_main = True
        """Set by the Trainer once the rank is known."""

    def add(self, hook: Hook) -> None:
        self.hooks.append(hook)

    def _here(self) -> list[Hook]:
        return [h for h in self.hooks if self.is_main or not h.rank_zero_only]

    def start(self, ctx: dict[str, Any]) -> None:
        for h in self._here():
            h.on_start(ctx)

    def steps(self, records: list[dict[str, Any]]) -> None:
        for h in self._here():
            h.on_steps(records)

    def eval(self, record: dict[str, Any]) -> None:
        for h in self._here():
            h.on_eval(record)

    def checkpoint(self, path: Path, step: int) -> None:
        for h in self._here():
            h.on_checkpoint(path, step)

    def end(self, summary: dict[str, Any]) -> None:
        for h in self._here():
            h.on_end(summary)

    def fail(self, status: str, exc: BaseException) -> None:
        for h in self._here():
            # The original failure is what matters; an observer's own error must not hide it.
            with contextlib.suppress(Exception):
                h.on_fail(status, exc)

    @contextlib.contextmanager
    def forward(self, trainer: Any) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for h in self._here():
                cm = h.forward_context(trainer)
                if cm is not None:
                    stack.enter_context(cm)
            yield

    def before_step(self, trainer: Any) -> None:
        for h in self._here():
            h.before_step(trainer)

    def after_backward(self, trainer: Any, loss_sum: Any, data_wait_s: float) -> StepDecision:
        decision = StepDecision()
        for h in self._here():
            decision = decision.merge(h.after_backward(trainer, loss_sum, data_wait_s))
        return decision
