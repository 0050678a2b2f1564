"""Fault tolerance of the training loop, as one object the engine calls at a few points.

`FaultGuard` owns: preemption (SIGTERM/SIGUSR1 only set a flag; the ranks agree on it at the
next step boundary, save and exit with REQUEUE_EXIT_CODE), bad steps (NaN/Inf loss and loss
spikes by a z-score over a sliding window: skip | rollback | stop), stragglers (ranks share
their local step times every N steps) and hangs (a watchdog thread per rank that names the
rank and step that stopped answering, through the rendezvous store, and ends the job).

Also here: checkpoint-interval advice from a measured checkpoint cost (Young 1974 / Daly 2006,
through the planner's hpcml.plan.cost), and fault injection for tests and drills
(HPCML_FAULT_INJECT, see `FaultInjector`).
"""

from __future__ import annotations

import contextlib
import faulthandler
import math
import os
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import nn

from hpcml.config import RunConfig
from hpcml.distributed.parallel import unwrap
from hpcml.distributed.pipeline import forward_modules
from hpcml.distributed.runtime import (
    Runtime,
    all_reduce_max,
    all_reduce_sum,
    broadcast_object,
    dump_flight_recorder,
)
from hpcml.distributed.sidechannel import HeartBoard
from hpcml.errors import REQUEUE_EXIT_CODE, Preempted, WorkFailed
from hpcml.records import EXCLUDE_NODES, RunLog, add_excluded_nodes, write_json_atomic
from hpcml.train.checkpoint import phase as ckpt_phase
from hpcml.train.checkpoint import store as ckpt
from hpcml.train.fault import straggler
from hpcml.train.fault.inject import INJECT_ENV, FaultInjector
from hpcml.train.fault.notice import NoticeWatcher
from hpcml.train.fault.policy import (
    CKPT_TIMEOUT_FLOOR_S,
    checkpoint_advice,
    checkpoint_timeout,
    require_checkpoints_for_restarts,
    worker_outcome,
)
from hpcml.train.fault.stop_signals import PreemptionFlag, agreed
from hpcml.train.fault.watchdog import Watchdog

__all__ = [
    "REQUEUE_EXIT_CODE",
    "FaultGuard",
    "INJECT_ENV",
    "FaultInjector",
    "PreemptionFlag",
    "SpikeDetector",
    "Verdict",
    "Watchdog",
    "checkpoint_advice",
    "require_checkpoints_for_restarts",
    "worker_outcome",
]

DUE_PROBE_STEPS = 10
"""With several ranks, time-based checkpoints are decided every this many steps."""


# --- bad steps -----------------------------------------------------------------------------


class SpikeDetector:
    """z-score of a loss against the mean and standard deviation of the last `window` good ones;
    only upward spikes count (a falling loss is progress)."""

    def __init__(self, zscore: float | None, window: int) -> None:
        self.zscore = zscore
        self.window: deque[float] = deque(maxlen=window)

    def score(self, loss: float) -> float | None:
        if self.zscore is None or len(self.window) < self.window.maxlen:  # type: ignore[operator]
            return None
        mean = statistics.fmean(self.window)
        std = statistics.pstdev(self.window, mean)
        if std <= 0.0:
            return None
        return (loss - mean) / std

    def is_spike(self, loss: float) -> bool:
        z = self.score(loss)
        return z is not None and self.zscore is not None and z > self.zscore

    def add(self, loss: float) -> None:
        self.window.append(loss)


@dataclass
class Verdict:
    """What the loop does with the step it just computed (every rank gets the same verdict)."""

    skip: bool = False
    rollback_to: Path | None = None
    preempt: bool = False
    interrupt: bool = False


# --- the guard -----------------------------------------------------------------------------


class FaultGuard:
    """The engine's one handle on fault tolerance. Create it right after the runtime (so that a
    preemption during setup is honoured), `attach` it once the model and run folder exist, and
    call `begin_step` / `check` every step."""

    def __init__(self, cfg: RunConfig, rt: Runtime) -> None:
        self.cfg = cfg
        self.fc = cfg.fault
        self.rt = rt
        # Ctrl-C stops at a step boundary, on several ranks the same (hpcml.train.fault.stop_signals).
        self.preemption = PreemptionFlag(
            self.fc.preempt_signals, interrupt=True, escalate=rt.world_size == 1
        )
        self.preemption.install()
        self.spikes = SpikeDetector(self.fc.spike_zscore, self.fc.spike_window)
        self.injector: FaultInjector | None = None
        self.current_step = 0
        self.load_s: float | None = None
        """Seconds the resume's checkpoint read took (the restart cost Daly's interval uses)."""
        self.counts = {
            "nonfinite_steps": 0,
            "spike_steps": 0,
            "skipped_steps": 0,
            "rollbacks": 0,
            "dropped_batches": 0,
        }
        self.stragglers: dict[int, int] = {}
        self.preempted_at: int | None = None
        self._bad_in_a_row = 0
        self._drop_at: dict[int, int] = {}
        self.timer = straggler.StepTimer(rt.device)
        self.persistent = straggler.Persistence(self.fc.straggler_exclude_after)
        self._handles: list[Any] = []
        self._timings_from = len(ckpt.timings)
        self._save_bytes: list[int] = []
        """Bytes of this rank's saves (checkpointing), in the order of ckpt.timings."""
        self.watchdog: Watchdog | None = None
        self.notices: NoticeWatcher | None = None
        self._last_save_t = time.monotonic()
        self.run_dir: Path | None = None
        self.log: RunLog | None = None
        self.warn: Callable[[str], None] = lambda m: None

    # -- set-up and tear-down --------------------------------------------------------------

    def attach(
        self,
        model: nn.Module,
        run_dir: Path,
        log: RunLog | None,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.log = log
        if self.rt.is_main:
            self.warn = warn or (lambda m: print(f"warning: {m}", file=sys.stderr, flush=True))
        # Launchers and tests find the workers here (an elastic restart rewrites them).
        pid_file = run_dir / "pids" / f"rank-{self.rt.rank}.pid"
        pid_file.parent.mkdir(parents=True, exist_ok=True)
        pid_file.write_text(f"{os.getpid()}\n")
        inner = unwrap(model)  # inside DDP: its pre-forward buffer broadcast is not local time
        self._handles = [
            handle
            for module in forward_modules(inner)  # each pipeline stage of this rank
            for handle in (
                module.register_forward_pre_hook(self._pre_forward),
                module.register_forward_hook(self._post_forward),
            )
        ]
        if self.fc.straggler_every:
            self.timer.attach(inner)
        if self.fc.preempt_notice != "none" and self.rt.local_rank == 0:
            self.notices = NoticeWatcher(
                self.fc.preempt_notice,
                self._on_notice,
                self.fc.preempt_notice_every_s,
                self.fc.preempt_notice_url,
                self.warn,
            ).start()
        self.watch_checkpoints()

    def watch_checkpoints(self) -> None:
        """Start fault injection and the watchdog (once): called before a resume's checkpoint
        read, so a read that hangs (the `read` phase) ends after fault.checkpoint_timeout_s
        like a stalled save; the idle check arms only at the first step."""
        if self.injector is None:
            self.injector = FaultInjector.from_env(self.rt.rank)
            if self.injector is not None:
                ckpt_phase.hook = self.injector.checkpoint_phase
        if self.watchdog is not None:
            return
        timeout = self.watchdog_timeout_s()
        ckpt_timeout, grace = self.fc.checkpoint_timeout_s, self.fc.preempt_grace_s
        if ckpt_timeout is None:  # set for each save and load (checkpointing)
            ckpt_timeout = CKPT_TIMEOUT_FLOOR_S
        if timeout > 0 or ckpt_timeout > 0 or grace > 0:
            self.watchdog = Watchdog(
                timeout,
                self.rt,
                HeartBoard(self.rt),
                self._hang,
                checkpoint_timeout_s=ckpt_timeout,
                preemption=self.preemption,
                preempt_grace_s=grace,
            )
            self.watchdog.start()

    def watchdog_timeout_s(self) -> float:
        if self.fc.watchdog_s is not None:
            return float(self.fc.watchdog_s)
        return 0.9 * self.cfg.parallel.timeout_s

    def _on_notice(self, what: str) -> None:
        self.preemption.notice(what)
        self.warn(f"{what}: saving a checkpoint at the next step boundary.")

    def close(self) -> None:
        self.preemption.restore()
        ckpt_phase.hook = None
        if self.notices is not None:
            self.notices.stop()
            self.notices = None
        for h in self._handles:
            h.remove()
        self._handles = []
        self.timer.close()
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None

    # -- forward hooks: local compute time, progress, injected faults ----------------------

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        if module.training:
            if self.fc.straggler_every:
                self.timer.forward_started()
            if self.injector is not None:
                self.injector.before_forward(self.current_step)

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self.watchdog is not None:
            self.watchdog.tick(self.current_step)
        if not module.training:
            return None
        if self.injector is not None:
            return self.injector.after_forward(output, self.current_step)
        return None

    # -- per step --------------------------------------------------------------------------

    def begin_step(self, step: int, drop_batch: Callable[[], Any]) -> None:
        """Before the step's first micro-batch: after a rollback, skip the offending batch."""
        self.current_step = step + 1
        if self.watchdog is not None:
            self.watchdog.step = self.current_step  # the step a stall would be reported at
        for _ in range(self._drop_at.pop(self.current_step, 0)):
            drop_batch()
            self.counts["dropped_batches"] += 1

    def check(
        self,
        step: int,
        loss_sum: torch.Tensor,
        data_wait_s: float,
        grad_norm: torch.Tensor | None = None,
    ) -> Verdict:
        """After backward, before the optimizer step. One collective of a few numbers: the loss
        (so every rank judges the same global loss), the global gradient norm (the same on
        every rank; a finite loss can still have a NaN/Inf gradient) and the preemption flags."""
        n = step + 1
        self.timer.end_step(data_wait_s)
        flags = loss_sum.new_tensor(self.preemption.flags()).float()
        norm = loss_sum.new_zeros(1) if grad_norm is None else grad_norm.float().reshape(1)
        t = torch.cat([loss_sum.detach().float().reshape(1), norm.to(loss_sum.device), flags])
        all_reduce_sum(self.rt, t)
        total, norm_sum, *summed = t.tolist()
        loss = total / self.rt.world_size
        preempt, interrupt = agreed(summed)
        if self.watchdog is not None:
            self.watchdog.tick(n)
        if self.fc.straggler_every and n % self.fc.straggler_every == 0:
            self._check_stragglers(n)

        if not (math.isfinite(loss) and math.isfinite(norm_sum)):
            kind, policy = "nonfinite", self.fc.nan_policy
            self.counts["nonfinite_steps"] += 1
        elif self.spikes.is_spike(loss):
            kind, policy = "spike", self.fc.spike_policy
            self.counts["spike_steps"] += 1
        else:
            self.spikes.add(loss)
            self._bad_in_a_row = 0
            return Verdict(preempt=preempt, interrupt=interrupt)

        self._bad_in_a_row += 1
        what = "NaN/Inf" if kind == "nonfinite" else f"a spike ({self._zdesc(loss)})"
        if kind == "nonfinite" and math.isfinite(loss):
            what = f"finite ({loss:.4g}) but its gradient norm was {norm_sum}"
        self._event(
            {
                "event": kind,
                "step": n,
                "loss": loss if math.isfinite(loss) else str(loss),
                "policy": policy,
            }
        )
        if policy == "stop":
            raise WorkFailed(
                f"the loss at step {n} was {what} and fault.{kind_key(kind)}=stop; lower "
                "optim.lr, set optim.grad_clip, or choose skip or rollback."
            )
        if self._bad_in_a_row > self.fc.max_bad_steps:
            raise WorkFailed(
                f"{self._bad_in_a_row} bad steps in a row up to step {n} (last one {what}), more "
                f"than fault.max_bad_steps={self.fc.max_bad_steps}; the model does not recover, "
                "lower optim.lr or resume from an earlier checkpoint."
            )
        if policy == "rollback":
            target = self._rollback_target(n, what)
            if target is not None:
                return Verdict(rollback_to=target, preempt=preempt, interrupt=interrupt)
        self.counts["skipped_steps"] += 1
        self.warn(f"step {n}: the loss was {what}; skipped the update.")
        return Verdict(skip=True, preempt=preempt, interrupt=interrupt)

    def _zdesc(self, loss: float) -> str:
        z = self.spikes.score(loss)
        return f"loss {loss:.4g}, z-score {z:.1f}" if z is not None else f"loss {loss:.4g}"

    def _rollback_target(self, n: int, what: str) -> Path | None:
        if self.counts["rollbacks"] >= self.fc.max_rollbacks:
            raise WorkFailed(
                f"the loss at step {n} was {what} after {self.counts['rollbacks']} rollbacks "
                f"(fault.max_rollbacks={self.fc.max_rollbacks}); lower optim.lr or set "
                "optim.grad_clip."
            )
        ckpt.wait_pending()
        target = None
        if self.rt.is_main and self.run_dir is not None:
            # sizes here; ckpt.load checks the contents, each file once on one rank
            target = ckpt.find_latest(self.run_dir / "checkpoints", self.warn, deep=False)
        target = broadcast_object(self.rt, target)
        if target is None:
            self.warn(f"step {n}: the loss was {what} but there is no checkpoint to roll back to.")
            return None
        to_step = ckpt.step_of(target) or 0
        # Replaying from the checkpoint reaches step n with the same batch: drop it then.
        self._drop_at[n] = self._drop_at.get(n, 0) + self.cfg.train.grad_accum
        self.counts["rollbacks"] += 1
        self.spikes.window.clear()
        self._bad_in_a_row = 0
        self._event({"event": "rollback", "step": n, "to_step": to_step, "checkpoint": str(target)})
        self.warn(f"step {n}: the loss was {what}; rolled back to {target}, skipping that batch.")
        return Path(target)

    def straggler_series(self) -> dict[int, int]:
        """Flags per rank for the metrics: every rank at 0 while the comparison runs (a counter
        that exists at 0 tells "checked, none slow" from "not checked"), none when it is off."""
        if not (self.fc.straggler_every and self.rt.world_size > 1):
            return dict(self.stragglers)
        return {r: self.stragglers.get(r, 0) for r in range(self.rt.world_size)}

    def _check_stragglers(self, n: int) -> None:
        """Every rank at the same step: compare compute times (see hpcml.train.fault.straggler)."""
        events = straggler.compare(self.rt, self.timer, self.fc.straggler_factor, n)
        self._exclude(self.persistent.update(events, self.rt.world_size), n)
        for event in events:
            rank, t, ref = event["rank"], event["local_step_s"], event["median_s"]
            self.stragglers[rank] = self.stragglers.get(rank, 0) + 1
            self._event(event)
            nvml = event.get("nvml") or {}
            clocks = (
                f"; SM clock {nvml['sm_clock_mhz']}/{nvml['sm_clock_max_mhz']} MHz, clock "
                f"events {', '.join(nvml['clock_event_reasons']) or 'none'}"
                if "sm_clock_mhz" in nvml
                else ""
            )
            self.warn(
                f"step {n}: rank {rank} ({event['host']}, {event['device']}) is a straggler: "
                f"{t * 1000:.1f} ms of local work per step, {t / ref:.1f}x the median "
                f"{ref * 1000:.1f} ms (fault.straggler_factor={self.fc.straggler_factor:g})"
                f"{clocks}."
            )

    def _exclude(self, nodes: list[str], n: int) -> None:
        """Persistent stragglers' nodes into the run folder's exclusion list (rank 0)."""
        if nodes and self.rt.is_main and self.run_dir is not None:
            listed = add_excluded_nodes(self.run_dir, nodes)
            self.warn(
                f"step {n}: node(s) {', '.join(nodes)} straggled at "
                f"{self.fc.straggler_exclude_after} checks in a row; a requeued SLURM "
                f"job leaves out {', '.join(listed)} ({self.run_dir / EXCLUDE_NODES})."
            )

    # -- checkpoints, preemption, hangs ----------------------------------------------------

    @contextlib.contextmanager
    def checkpointing(self, nbytes: int | None = None, saving: bool = True) -> Iterator[None]:
        """Around a save or load of `nbytes` on this rank: a long write is not a hang, and each
        checkpoint phase gets its timeout (`fault_policy.checkpoint_timeout`)."""
        if self.watchdog is not None and nbytes is not None:
            dog = self.watchdog
            dog.checkpoint_timeout_s, dog.checkpoint_timeout_why = checkpoint_timeout(
                self.fc.checkpoint_timeout_s, nbytes, self._write_bytes_per_s()
            )
        if saving and nbytes is not None:
            self._save_bytes.append(nbytes)
        cm = self.watchdog.paused() if self.watchdog is not None else contextlib.nullcontext()
        with cm:
            yield
        self._last_save_t = time.monotonic()

    def _write_bytes_per_s(self) -> float | None:
        """The bandwidth of this run's newest save that has measured one (until durable; a
        background save on ranks other than 0 does not know that)."""
        saves = ckpt.timings[self._timings_from :]
        for t, nbytes in reversed(list(zip(saves, self._save_bytes, strict=False))):
            seconds = t.total_s if t.total_s is not None else (None if t.background else t.stall_s)
            if seconds:
                return nbytes / seconds
        return None

    def checkpoint_due(self, step: int) -> bool:
        """train.checkpoint_every_s: whether that long has passed since the last save. Ranks
        decide together (the largest elapsed time, one all-reduce every DUE_PROBE_STEPS steps),
        so they never disagree about a collective save."""
        every_s = self.cfg.train.checkpoint_every_s
        if not every_s:
            return False
        if self.rt.world_size > 1 and step % DUE_PROBE_STEPS:
            return False
        elapsed = torch.tensor([time.monotonic() - self._last_save_t], dtype=torch.float64)
        if self.rt.world_size > 1:
            elapsed = all_reduce_max(self.rt, elapsed.to(self.rt.device)).cpu()
        return float(elapsed.item()) >= every_s

    def stop_for_preemption(self, step: int, path: Path) -> NoReturn:
        """Every rank calls this at the same step, after saving `path`; raises `Preempted`."""
        ckpt.wait_pending()
        self.preempted_at = step
        by = self.preemption.describe()
        self._event({"event": "preempted", "step": step, "signal": by, "checkpoint": str(path)})
        raise Preempted(
            f"preempted by {by}: saved checkpoint {path} at step {step} and stopped; continue "
            f"with --resume auto (exit code {REQUEUE_EXIT_CODE} asks a scheduler to requeue).",
            checkpoint=str(path),
        )

    def stop_for_interrupt(self, step: int) -> NoReturn:
        """Every rank calls this at the same step after Ctrl-C: no checkpoint, status
        "interrupted", exit 130 (a KeyboardInterrupt, raised where it is safe)."""
        ckpt.wait_pending()
        self._event({"event": "interrupted", "step": step, "signal": "SIGINT"})
        raise KeyboardInterrupt(f"SIGINT: every rank stopped after step {step}")

    def _hang(self, message: str) -> None:
        dumped = dump_flight_recorder(self.rt)
        if dumped is not None:
            message += f" NCCL's flight recorder of this rank: {dumped} (read with torchfrtrace)."
        print(f"error: {message}", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        if self.rt.is_main and self.run_dir is not None:
            with contextlib.suppress(Exception):
                write_json_atomic(
                    self.run_dir / "summary.json",
                    {
                        "status": "failed",
                        "error": message,
                        "run_dir": str(self.run_dir),
                        "fault": self.summary(),
                    },
                )
        # The main thread is stuck (that is the point), so no exception can reach it.
        os._exit(WorkFailed.exit_code)

    # -- records ---------------------------------------------------------------------------

    def _event(self, rec: dict[str, Any]) -> None:
        if self.rt.is_main and self.log is not None:
            self.log.write({"kind": "fault", "time": time.time(), **rec})

    def summary(self) -> dict[str, Any]:
        checkpoints = ckpt.timing_summary(ckpt.timings[self._timings_from :])
        checkpoints["load_s"] = self.load_s  # the resume's read (None: started afresh)
        return {
            **self.counts,
            "stragglers": {str(r): c for r, c in sorted(self.stragglers.items())},
            "preempted_at": self.preempted_at,
            "watchdog_s": self.watchdog_timeout_s(),
            "checkpoints": checkpoints,
        }


def kind_key(kind: str) -> str:
    return "nan_policy" if kind == "nonfinite" else "spike_policy"
