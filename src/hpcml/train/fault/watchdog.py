"""The hang watchdog of the training loop (one thread per rank), split from hpcml.train.fault.guard.

It names the rank that stopped making progress, or the rank and checkpoint phase that stalled,
through the rendezvous store (HeartBoard), and ends the job with one sentence.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from hpcml.distributed.runtime import Runtime
from hpcml.distributed.sidechannel import HeartBoard
from hpcml.train.checkpoint import phase as ckpt_phase

if TYPE_CHECKING:
    from hpcml.train.fault.stop_signals import PreemptionFlag

__all__ = ["Watchdog"]


class Watchdog:
    """A thread per rank: posts this rank's progress to the HeartBoard and ends the process
    with a sentence when
    - the rank has made no progress for `timeout_s` outside checkpoint I/O (names the rank(s)
      furthest behind),
    - a checkpoint phase (write, fsync, manifest, rename, ...; see ckpt_phase) has run for
      `checkpoint_timeout_s` (names the rank and the phase: a hung filesystem),
    - a preemption signal came while a checkpoint phase ran and `preempt_grace_s` passed
      without that phase ending (the scheduler's SIGKILL is near: exit before it, saying why).

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
        checkpoint_timeout_s: float = 0.0,
        preemption: PreemptionFlag | None = None,
        preempt_grace_s: float = 0.0,
    ) -> None:
        self.timeout_s = timeout_s
        self.checkpoint_timeout_s = checkpoint_timeout_s
        self.checkpoint_timeout_why = f"fault.checkpoint_timeout_s={checkpoint_timeout_s:g}"
        """How the timeout was chosen, for the message (see FaultGuard.checkpointing)."""
        self.preemption = preemption
        self.preempt_grace_s = preempt_grace_s
        self.rt = rt
        self.board = board
        self.on_fire = on_fire
        shortest = min(t for t in (timeout_s, checkpoint_timeout_s, preempt_grace_s, 10.0) if t > 0)
        self.poll_s = poll_s if poll_s is not None else max(0.05, min(1.0, shortest / 10))
        self.grace_s = 0.0 if rt.is_main else max(1.0, 0.2 * shortest)
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

    def _post(self, now: float, ph: ckpt_phase.Phase | None) -> None:
        self.board.post(
            {
                "step": self.step,
                "progress": self.progress,
                "idle_s": now - self.last_progress,
                "pid": os.getpid(),
                "phase": ph.name if ph else None,
                "phase_s": ph.elapsed_s(now) if ph else 0.0,
            }
        )

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            now = time.monotonic()
            ph = ckpt_phase.longest()
            self._post(now, ph)
            message = self.check(now, ph)
            if message is not None:
                self.on_fire(message)
                return

    def check(self, now: float, ph: ckpt_phase.Phase | None) -> str | None:
        """The sentence to end the job with, or None while all is well."""
        if ph is not None:
            ran = ph.elapsed_s(now)
            if self.checkpoint_timeout_s and ran > self.checkpoint_timeout_s + self.grace_s:
                return self.diagnose_checkpoint(ph, ran)
            # Only a save already under way when the signal came (its write began before;
            # a background save's fsync may begin after): the save the signal asks for
            # starts after it and has fault.checkpoint_timeout_s like any other.
            asked = self.preemption.received_at if self.preemption is not None else None
            began = ph.save_started if ph.save_started is not None else ph.started
            late = asked is not None and began < asked and now - asked > self.preempt_grace_s
            if self.preempt_grace_s and late:
                return self.diagnose_checkpoint(ph, ran, preempted_for=now - (asked or now))
        if not self.armed or self._paused or not self.timeout_s:
            return None
        idle = now - self.last_progress
        if idle > self.timeout_s + self.grace_s:
            return self.diagnose(idle)
        return None

    def diagnose_checkpoint(
        self, ph: ckpt_phase.Phase, ran_s: float, preempted_for: float | None = None
    ) -> str:
        """Name the rank and phase that stalled. A rank only waiting for the others (phase
        `wait`) names the rank(s) whose own phase has run longest, from the HeartBoard."""
        who, name = [self.rt.rank], ph.name
        if ph.name == "wait":
            beats = {r: b for r, b in self.board.read_all().items() if b and b.get("phase")}
            busy = {r: b for r, b in beats.items() if b["phase"] != "wait"}
            if busy:
                longest = max(b["phase_s"] for b in busy.values())
                who = sorted(r for r, b in busy.items() if b["phase_s"] == longest)
                name = busy[who[0]]["phase"]
        names = ("rank " if len(who) == 1 else "ranks ") + ", ".join(str(r) for r in who)
        what = f"the {name} phase of the checkpoint of step {ph.step}"
        if preempted_for is not None:
            return (
                f"{names} stalled in {what} ({ran_s:.0f} s) when a preemption signal came "
                f"{preempted_for:.0f} s ago (fault.preempt_grace_s={self.preempt_grace_s:g}); "
                "ending without a new checkpoint: the newest complete one is kept, resume "
                "with --resume auto."
            )
        return (
            f"{names} stalled in {what} for {ran_s:.0f} s "
            f"({self.checkpoint_timeout_why}); ending the job instead "
            "of hanging: check the run folder's filesystem, then resume with --resume auto."
        )

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
        names = (
            "rank " + ", ".join(str(r) for r in who)
            if len(who) == 1
            else ("ranks " + ", ".join(str(r) for r in who))
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
