"""The fault guard (`hpcml.train.fault.FaultGuard`) as a behaviour hook of the Trainer.

Two paths:
- on the device (the default guards: NaN/Inf skip, no spike detection): no host sync and no
  collective per step. The Trainer skips a step whose gradients are not finite inside the
  fused optimizer (`found_inf`, as GradScaler does), every rank alike because every rank
  decides from the same reduced gradients. Skipped steps keep their number; they are reported
  at the next log flush, whose one collective also carries the preemption flags
  (or every `fault.preempt_check_every` steps).
- on the host (spike detection, or a `rollback` / `stop` policy, which need each step's global
  loss before the update): one collective and one sync per step (`FaultGuard.check`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from hpcml.distributed.runtime import all_reduce_sum
from hpcml.errors import WorkFailed
from hpcml.train.fault import FaultGuard
from hpcml.train.hooks import Hook, StepDecision
from hpcml.train.stop_signals import agreed


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

    def before_step(self, trainer: Any) -> None:
        if not self._timing_optimizer and self.guard.fc.straggler_every:
            self.guard.timer.attach(None, trainer.optimizer)  # optimizer hooks only
            self._timing_optimizer = True
        self.guard.begin_step(trainer.step, drop_batch=trainer.train_data.next)

    def after_backward(self, trainer: Any, loss_sum: Any, data_wait_s: float) -> StepDecision:
        if self.on_host:
            verdict = self.guard.check(trainer.step, loss_sum, data_wait_s)
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
        return StepDecision(preempt=preempt, skip_on_device=True, interrupt=interrupt)

    def flush_flags(self) -> list[float]:
        """Carried by the log flush's collective: this rank's [preemption, Ctrl-C] flags."""
        return self.guard.preemption.flags()

    def on_flushed(self, records: list[dict[str, Any]], flags: list[float]) -> StepDecision:
        """After a flush: report the steps skipped on the device; whether any rank was asked
        to stop (a preemption, or Ctrl-C)."""
        g = self.guard
        for rec in records:
            loss = rec.get("loss")
            if loss is None or math.isfinite(loss):
                self.bad_in_a_row = 0
            else:
                self.bad_in_a_row += 1
                if self.bad_in_a_row > g.fc.max_bad_steps:
                    raise WorkFailed(
                        f"{self.bad_in_a_row} steps in a row up to step {rec['step']} had a "
                        f"NaN/Inf loss, more than fault.max_bad_steps={g.fc.max_bad_steps}; "
                        "the model does not recover, lower optim.lr or resume from an earlier "
                        "checkpoint."
                    )
                g.counts["nonfinite_steps"] += 1
                g.counts["skipped_steps"] += 1
                g._event(
                    {"event": "nonfinite", "step": rec["step"], "loss": str(loss), "policy": "skip"}
                )
                g.warn(f"step {rec['step']}: the loss was NaN/Inf; skipped the update.")
        preempt, interrupt = agreed(flags) if flags else (False, False)
        return StepDecision(preempt=preempt, interrupt=interrupt)
