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
import json
import math
import os
import signal
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import nn

from hpcml.config import RunConfig
from hpcml.distributed.parallel import unwrap
from hpcml.distributed.runtime import Runtime, all_gather_object, all_reduce_sum, broadcast_object
from hpcml.distributed.sidechannel import HeartBoard
from hpcml.errors import REQUEUE_EXIT_CODE, ConfigError, Preempted, WorkFailed
from hpcml.records import RunLog, write_json_atomic
from hpcml.train import checkpoint as ckpt

__all__ = [
    "REQUEUE_EXIT_CODE",
    "FaultGuard",
    "FaultInjector",
    "PreemptionFlag",
    "SpikeDetector",
    "Verdict",
    "Watchdog",
    "checkpoint_advice",
]

INJECT_ENV = "HPCML_FAULT_INJECT"


# --- preemption ----------------------------------------------------------------------------


class PreemptionFlag:
    """Signal handlers that only record the signal: saving inside a handler could interrupt the
    loop halfway through an optimizer step or a checkpoint write."""

    def __init__(self, names: Sequence[str]) -> None:
        self.signals = [getattr(signal, n) for n in names]
        self.received: int | None = None
        self._old: dict[int, Any] = {}

    def install(self) -> bool:
        if threading.current_thread() is not threading.main_thread():
            return False  # Python allows handlers only in the main thread
        for s in self.signals:
            self._old[s] = signal.signal(s, self._handler)
        return True

    def _handler(self, signum: int, _frame: object) -> None:
        if self.received is None:
            self.received = signum

    @property
    def requested(self) -> bool:
        return self.received is not None

    def restore(self) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()


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


# --- hangs ---------------------------------------------------------------------------------


class Watchdog:
    """A thread per rank: posts this rank's progress to the HeartBoard and, when the rank has
    made no progress for `timeout_s`, names the rank(s) furthest behind and ends the process.

    Rank 0 speaks first; the others wait a grace period so that one clear message (and
    summary.json) comes from rank 0 unless rank 0 itself is frozen.
    """

    def __init__(
        self,
        timeout_s: float,
        rt: Runtime,
        board: HeartBoard,
        on_fire: Callable[[str], None],
        poll_s: float | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.rt = rt
        self.board = board
        self.on_fire = on_fire
        self.poll_s = poll_s if poll_s is not None else max(0.05, min(1.0, timeout_s / 10))
        self.grace_s = 0.0 if rt.is_main else max(1.0, 0.2 * timeout_s)
        self.progress = 0
        self.step = 0
        self.last_progress = time.monotonic()
        self.armed = False
        self._paused = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hpcml-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def tick(self, step: int) -> None:
        """Called from the loop (cheap: no I/O); the thread publishes it."""
        self.progress += 1
        self.step = step
        self.last_progress = time.monotonic()
        self.armed = True

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
            self.last_progress = time.monotonic()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _post(self) -> None:
        self.board.post(
            {
                "step": self.step,
                "progress": self.progress,
                "idle_s": time.monotonic() - self.last_progress,
                "pid": os.getpid(),
            }
        )

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._post()
            if not self.armed or self._paused:
                continue
            idle = time.monotonic() - self.last_progress
            if idle > self.timeout_s + self.grace_s:
                self.on_fire(self.diagnose(idle))
                return

    def diagnose(self, idle_s: float) -> str:
        beats = self.board.read_all()
        silent = [r for r, b in beats.items() if b is None]
        known = {r: b for r, b in beats.items() if b is not None}
        if silent:
            who, step = silent, self.step
        else:
            least = min(b["progress"] for b in known.values())
            behind = sorted(r for r, b in known.items() if b["progress"] == least)
            who = behind if len(behind) < len(known) else sorted(known)
            step = min(int(known[r]["step"]) for r in who)
        names = "rank " + ", ".join(str(r) for r in who) if len(who) == 1 else (
            "ranks " + ", ".join(str(r) for r in who)
        )
        if len(who) == self.rt.world_size and self.rt.world_size > 1:
            cause = f"{names} all stopped making progress"
        else:
            cause = f"{names} stopped answering"
        return (
            f"{cause} at step {step} (rank {self.rt.rank} waited {idle_s:.0f} s, "
            f"fault.watchdog_s={self.timeout_s:g}); ending the job instead of hanging: see the "
            f"stack dump of that rank above, and resume with --resume auto."
        )


# --- fault injection (tests, chaos drills) --------------------------------------------------


class FaultInjector:
    """Faults injected through the model's forward hooks, read from HPCML_FAULT_INJECT (JSON):

    {"slow":  {"rank": 1, "seconds": 0.05}}               every training forward on rank 1
    {"stall": {"rank": 1, "step": 5, "seconds": 3600}}    once, at step 5 (a hang)
    {"nan":   {"step": 7, "rank": 0}}                     once: that forward's output becomes NaN
    {"spike": {"step": 30, "scale": 100.0}}               once: output x -scale (confidently
                                                          wrong logits, a large loss)

    Steps are 1-based optimizer steps; "rank" left out means every rank.
    """

    def __init__(self, spec: dict[str, Any], rank: int) -> None:
        known = {"slow", "stall", "nan", "spike"}
        unknown = set(spec) - known
        if unknown:
            raise ConfigError(
                f"{INJECT_ENV} names unknown faults {sorted(unknown)}; known are {sorted(known)}."
            )
        self.rank = rank
        self.spec = {k: v for k, v in spec.items() if v.get("rank", rank) == rank}
        self.fired: set[str] = set()

    @classmethod
    def from_env(cls, rank: int) -> FaultInjector | None:
        raw = os.environ.get(INJECT_ENV)
        if not raw:
            return None
        try:
            spec = json.loads(raw)
        except json.JSONDecodeError:
            raise ConfigError(f"{INJECT_ENV} is not valid JSON: {raw[:100]!r}.") from None
        return cls(spec, rank)

    def _once(self, name: str, step: int) -> bool:
        s = self.spec.get(name)
        if s is None or name in self.fired or int(s["step"]) != step:
            return False
        self.fired.add(name)
        return True

    def before_forward(self, step: int) -> None:
        if "slow" in self.spec:
            time.sleep(float(self.spec["slow"]["seconds"]))
        if self._once("stall", step):
            time.sleep(float(self.spec["stall"].get("seconds", 3600)))

    def after_forward(self, output: Any, step: int) -> Any:
        if self._once("nan", step):
            return output * float("nan")
        if self._once("spike", step):
            return output * -float(self.spec["spike"].get("scale", 100.0))
        return output


# --- the guard -----------------------------------------------------------------------------


class FaultGuard:
    """The engine's one handle on fault tolerance. Create it right after the runtime (so that a
    preemption during setup is honoured), `attach` it once the model and run folder exist, and
    call `begin_step` / `check` every step."""

    def __init__(self, cfg: RunConfig, rt: Runtime) -> None:
        self.cfg = cfg
        self.fc = cfg.fault
        self.rt = rt
        self.preemption = PreemptionFlag(self.fc.preempt_signals)
        self.preemption.install()
        self.spikes = SpikeDetector(self.fc.spike_zscore, self.fc.spike_window)
        self.injector: FaultInjector | None = None
        self.current_step = 0
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
        self._fwd_s = 0.0
        self._fwd_t0: float | None = None
        self._local_s: list[float] = []
        self._handles: list[Any] = []
        self._timings_from = len(ckpt.timings)
        self.watchdog: Watchdog | None = None
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
        self.injector = FaultInjector.from_env(self.rt.rank)
        if self.rt.is_main:
            self.warn = warn or (lambda m: print(f"warning: {m}", file=sys.stderr, flush=True))
        # Launchers and tests find the workers here (an elastic restart rewrites them).
        pid_file = run_dir / "pids" / f"rank-{self.rt.rank}.pid"
        pid_file.parent.mkdir(parents=True, exist_ok=True)
        pid_file.write_text(f"{os.getpid()}\n")
        inner = unwrap(model)  # inside DDP: its pre-forward buffer broadcast is not local time
        self._handles = [
            inner.register_forward_pre_hook(self._pre_forward),
            inner.register_forward_hook(self._post_forward),
        ]
        timeout = self.watchdog_timeout_s()
        if timeout > 0:
            self.watchdog = Watchdog(timeout, self.rt, HeartBoard(self.rt), self._hang)
            self.watchdog.start()

    def watchdog_timeout_s(self) -> float:
        if self.fc.watchdog_s is not None:
            return float(self.fc.watchdog_s)
        return 0.9 * self.cfg.parallel.timeout_s

    def close(self) -> None:
        self.preemption.restore()
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None

    # -- forward hooks: local compute time, progress, injected faults ----------------------

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        if module.training:
            self._fwd_t0 = time.perf_counter()
            if self.injector is not None:
                self.injector.before_forward(self.current_step)

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self.watchdog is not None:
            self.watchdog.tick(self.current_step)
        if not module.training:
            return None
        if self._fwd_t0 is not None:
            self._fwd_s += time.perf_counter() - self._fwd_t0
            self._fwd_t0 = None
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

    def check(self, step: int, loss_sum: torch.Tensor, data_wait_s: float) -> Verdict:
        """After backward, before the optimizer step. One collective of two numbers: the loss
        (so every rank judges the same global loss) and the preemption flags."""
        n = step + 1
        self._local_s.append(data_wait_s + self._fwd_s)
        self._fwd_s = 0.0
        flag = 1.0 if self.preemption.requested else 0.0
        t = torch.stack([loss_sum.detach().float().reshape(()), loss_sum.new_tensor(flag).float()])
        all_reduce_sum(self.rt, t)
        total, flags = t.tolist()
        loss = total / self.rt.world_size
        preempt = flags > 0
        if self.watchdog is not None:
            self.watchdog.tick(n)
        if self.fc.straggler_every and n % self.fc.straggler_every == 0:
            self._check_stragglers(n)

        if not math.isfinite(loss):
            kind, policy = "nonfinite", self.fc.nan_policy
            self.counts["nonfinite_steps"] += 1
        elif self.spikes.is_spike(loss):
            kind, policy = "spike", self.fc.spike_policy
            self.counts["spike_steps"] += 1
        else:
            self.spikes.add(loss)
            self._bad_in_a_row = 0
            return Verdict(preempt=preempt)

        self._bad_in_a_row += 1
        what = "NaN/Inf" if kind == "nonfinite" else f"a spike ({self._zdesc(loss)})"
        self._event({"event": kind, "step": n, "loss": loss if math.isfinite(loss) else str(loss),
                     "policy": policy})
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
                return Verdict(rollback_to=target, preempt=preempt)
        self.counts["skipped_steps"] += 1
        self.warn(f"step {n}: the loss was {what}; skipped the update.")
        return Verdict(skip=True, preempt=preempt)

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
            target = ckpt.find_latest(self.run_dir / "checkpoints", warn=self.warn)
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

    def _check_stragglers(self, n: int) -> None:
        window = self._local_s[-self.fc.straggler_every :]
        self._local_s = []
        mine = statistics.fmean(window) if window else 0.0
        times = all_gather_object(self.rt, mine)
        if self.rt.world_size < 2:
            return
        # median_low: with two ranks the reference is the faster one, not their mean.
        ref = statistics.median_low(times)
        if ref <= 0:
            return
        for rank, t in enumerate(times):
            if t > self.fc.straggler_factor * ref:
                self.stragglers[rank] = self.stragglers.get(rank, 0) + 1
                self._event({"event": "straggler", "step": n, "rank": rank,
                             "local_step_s": t, "median_s": ref, "ratio": t / ref})
                self.warn(
                    f"step {n}: rank {rank} is a straggler: {t * 1000:.1f} ms of local work per "
                    f"step, {t / ref:.1f}x the median {ref * 1000:.1f} ms "
                    f"(fault.straggler_factor={self.fc.straggler_factor:g})."
                )

    # -- checkpoints, preemption, hangs ----------------------------------------------------

    @contextlib.contextmanager
    def checkpointing(self) -> Iterator[None]:
        """Around a save or load: a long write is not a hang."""
        cm = self.watchdog.paused() if self.watchdog is not None else contextlib.nullcontext()
        with cm:
            yield

    def stop_for_preemption(self, step: int, path: Path) -> NoReturn:
        """Every rank calls this at the same step, after saving `path`; raises `Preempted`."""
        ckpt.wait_pending()
        self.preempted_at = step
        sig = self.preemption.received
        by = signal.Signals(sig).name if sig is not None else "a signal on another rank"
        self._event({"event": "preempted", "step": step, "signal": by, "checkpoint": str(path)})
        raise Preempted(
            f"preempted by {by}: saved checkpoint {path} at step {step} and stopped; continue "
            f"with --resume auto (exit code {REQUEUE_EXIT_CODE} asks a scheduler to requeue)."
        )

    def _hang(self, message: str) -> None:
        print(f"error: {message}", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        if self.rt.is_main and self.run_dir is not None:
            with contextlib.suppress(Exception):
                write_json_atomic(
                    self.run_dir / "summary.json",
                    {"status": "failed", "error": message, "run_dir": str(self.run_dir),
                     "fault": self.summary()},
                )
        # The main thread is stuck (that is the point), so no exception can reach it.
        os._exit(WorkFailed.exit_code)

    # -- records ---------------------------------------------------------------------------

    def _event(self, rec: dict[str, Any]) -> None:
        if self.rt.is_main and self.log is not None:
            self.log.write({"kind": "fault", "time": time.time(), **rec})

    def summary(self) -> dict[str, Any]:
        checkpoints = ckpt.timing_summary(ckpt.timings[self._timings_from :])
        return {
            **self.counts,
            "stragglers": {str(r): c for r, c in sorted(self.stragglers.items())},
            "preempted_at": self.preempted_at,
            "watchdog_s": self.watchdog_timeout_s(),
            "checkpoints": checkpoints,
        }


def kind_key(kind: str) -> str:
    return "nan_policy" if kind == "nonfinite" else "spike_policy"


# --- checkpoint interval -------------------------------------------------------------------
# The formulas live in the planner (hpcml.plan.cost, pure functions); here they are applied to a
# measured checkpoint cost and step time.


def checkpoint_advice(
    checkpoint_s: float,
    mtbf_s: float,
    restart_s: float = 0.0,
    step_time_s: float | None = None,
) -> dict[str, Any]:
    """Optimal interval and what failures cost at it: hpcml.plan.cost.checkpoint_plan (Daly
    2006, failures as a Poisson process), the same function `plan cost spot` uses."""
    from hpcml.plan.cost import checkpoint_plan  # only the advice verb needs it

    plan = checkpoint_plan(checkpoint_s, mtbf_s, restart_s)
    interval = plan.daly_interval_s
    out: dict[str, Any] = {
        "checkpoint_s": checkpoint_s,
        "mtbf_s": mtbf_s,
        "restart_s": restart_s,
        "young_interval_s": plan.young_interval_s,
        "daly_interval_s": interval,
        "expected_lost_work_per_failure_s": plan.lost_work_per_failure_s,
        "expected_overhead_fraction": plan.overhead_fraction,
        "expected_goodput": plan.goodput,
        "step_time_s": step_time_s,
        "checkpoint_every_steps": None,
    }
    if step_time_s:
        out["checkpoint_every_steps"] = max(1, round(interval / step_time_s))
    return out
