"""The fault guard (`hpcml.train.fault.guard.FaultGuard`) as a behaviour hook of the Trainer.

Two paths:
- on the device (the default guards: NaN/Inf skip, no spike detection): no host sync and no
  collective per step of its own. The Trainer skips a step whose global gradient norm is not
  finite inside the fused optimizer (`found_inf`, as GradScaler does), every rank alike
  because the norm is reduced over every rank's shards (`parallel.grad_norm`), even when one
  shard alone holds the NaN/Inf and the loss is finite. Skipped steps keep their number; the
  step record says `skipped` and gives the `grad_norm`; they are counted at the next log
  flush, whose one collective also carries the preemption flags. With several processes that
  flush also runs once `fault.stop_check_s` seconds' worth of steps have passed (the step time
  measured between flushes, agreed in the flush's collective, so every rank flushes at the same
  step): a stop is agreed within about that time whatever `train.log_every` is (or every
  `fault.preempt_check_every` steps, one collective each).
- on the host (spike detection, or a `rollback` / `stop` policy, which need each step's global
  loss before the update): one collective and one sync per step (`FaultGuard.check`), which
  judges the loss and the global gradient norm.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from hpcml.distributed.runtime import all_reduce_sum
from hpcml.errors import WorkFailed
from hpcml.train.fault.guard import FaultGuard
from hpcml.train.fault.stop_signals import agreed
from hpcml.train.hooks import Hook, StepDecision


def needs_host_check(guard: FaultGuard) -> bool:
    fc = guard.fc
    return fc.spike_zscore is not None or fc.nan_policy != "skip" or fc.spike_policy != "skip"


class FaultHook(Hook):
    rank_zero_only = False

    def __init__(self, guard: FaultGuard) -> None:
        self.guard = guard
        self.on_host = needs_host_check(guard)
        self.bad_in_a_row = 0
        self._timing_optimizer = False
        fc = guard.fc
        several = guard.rt.world_size > 1 and not self.on_host  # else: agreed every step
        self.stop_check_s = fc.stop_check_s if several and fc.preempt_check_every is None else None
        self.next_stop_check = 1
        """The step whose flush agrees on a stop next (the same on every rank); the first
        step's flush measures the step time."""
        self.step = 0
        self._flushed: tuple[int, float] | None = None
        """(step, time.monotonic()) of the last flush on this rank."""

    def stop_check_due(self, step: int) -> bool:
        """Whether the Trainer flushes after `step` to agree on a stop (fault.stop_check_s)."""
        return self.stop_check_s is not None and step >= self.next_stop_check

    def before_step(self, trainer: Any) -> None:
        if not self._timing_optimizer and self.guard.fc.straggler_every:
            self.guard.timer.attach(None, trainer.optimizer)  # optimizer hooks only
            self._timing_optimizer = True
        if self._flushed is None:
            self._flushed = (trainer.step, time.monotonic())
        self.guard.begin_step(trainer.step, drop_batch=trainer.train_data.next)

    def after_backward(self, trainer: Any, loss_sum: Any, data_wait_s: float) -> StepDecision:
        self.step = trainer.step + 1
        if self.on_host:
            verdict = self.guard.check(trainer.step, loss_sum, data_wait_s, trainer.grad_norm)
            return StepDecision(
                verdict.skip, verdict.rollback_to, verdict.preempt, interrupt=verdict.interrupt
            )
        g, n = self.guard, trainer.step + 1
        g.timer.end_step(data_wait_s)
        if g.watchdog is not None:
            g.watchdog.tick(n)
        if g.fc.straggler_every and n % g.fc.straggler_every == 0:
            g._check_stragglers(n)
        every = g.fc.preempt_check_every
        preempt = interrupt = False
        if trainer.rt.world_size == 1:  # no peer to agree with: every step, no collective
            preempt, interrupt = agreed(g.preemption.flags())
        elif every is not None and n % every == 0:
            flags = torch.tensor(g.preemption.flags(), device=trainer.rt.device)
            preempt, interrupt = agreed(all_reduce_sum(trainer.rt, flags).tolist())
        return StepDecision(preempt=preempt, interrupt=interrupt)

    def flush_flags(self) -> list[float]:
        """Carried by the log flush's collective: this rank's [preemption, Ctrl-C] flags and
        its seconds per step since the last flush (0 when no step ran since)."""
        step_s = 0.0
        if self._flushed is not None and self.step > self._flushed[0]:
            step_s = (time.monotonic() - self._flushed[1]) / (self.step - self._flushed[0])
        return [*self.guard.preemption.flags(), step_s]

    def _plan_stop_check(self, step_s: float) -> None:
        """The next flush that agrees on a stop: `stop_check_s` of steps at the step time all
        ranks measured (their mean, the same number everywhere), at least one step ahead."""
        self._flushed = (self.step, time.monotonic())
        if self.stop_check_s is not None and step_s > 0:
            self.next_stop_check = self.step + max(1, int(self.stop_check_s / step_s))

    def on_flushed(self, records: list[dict[str, Any]], flags: list[float]) -> StepDecision:
        """After a flush: report the steps skipped on the device; whether any rank was asked
        to stop (a preemption, or Ctrl-C)."""
        g = self.guard
        for rec in records:
            loss, skipped = rec.get("loss"), rec.get("skipped")
            bad_loss = loss is not None and not math.isfinite(loss)
            if not (bad_loss or skipped):
                self.bad_in_a_row = 0
                continue
            self.bad_in_a_row += 1
            if self.bad_in_a_row > g.fc.max_bad_steps:
                raise WorkFailed(
                    f"{self.bad_in_a_row} steps in a row up to step {rec['step']} had a "
                    f"NaN/Inf loss or gradient, more than fault.max_bad_steps="
                    f"{g.fc.max_bad_steps}; the model does not recover, lower optim.lr or "
                    "resume from an earlier checkpoint."
                )
            g.counts["nonfinite_steps"] += 1
            # Without a gradient norm (fp16 loss scaling) the scaler dropped it.
            dropped = skipped is not False
            g.counts["skipped_steps"] += dropped
            what = "loss" if bad_loss else f"gradient norm ({rec.get('grad_norm')})"
            g._event(
                {
                    "event": "nonfinite",
                    "step": rec["step"],
                    "loss": loss if loss is not None and math.isfinite(loss) else str(loss),
                    "grad_norm": str(rec.get("grad_norm")),
                    "policy": "skip" if dropped else "applied",
                }
            )
            g.warn(
                f"step {rec['step']}: the {what} was NaN/Inf; "
                + ("skipped the update." if dropped else "its gradients were finite and applied.")
            )
        preempt, interrupt = agreed(flags[:2]) if flags else (False, False)
        if flags:
            self._plan_stop_check(flags[2])
        return StepDecision(preempt=preempt, interrupt=interrupt)
