"""Signals that ask a training run to stop, recorded by handlers and acted on by every rank at
the same step boundary.

A preemption (SIGTERM, SIGUSR1 from a scheduler, or a cloud's notice) saves a checkpoint and
exits with REQUEUE_EXIT_CODE. Ctrl-C (SIGINT) stops the run at a step boundary without a
checkpoint (status "interrupted", exit 130). It used to raise KeyboardInterrupt wherever it
landed. On several processes, in the middle of a gloo collective one rank left while its peer
still waited, and at interpreter exit the DDP reducer's destructor (holding the GIL) joined a
gloo thread that needed the GIL to free that collective's tensors: the worker never exited
and torchrun killed it 120 s later (seen in CI). On one process, inside a checkpoint write,
torch.distributed.checkpoint turned it into a CheckpointException: a traceback and exit 1.

One process acts on the flag at the end of the step it is in, and a second Ctrl-C raises
KeyboardInterrupt at once (`escalate`). Several ranks agree through one collective that sums
`PreemptionFlag.flags()` of every rank (`agreed` reads the sum); a second Ctrl-C is the
torchrun agent's to act on (hpcml.launch.agent kills the workers).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Sequence
from typing import Any


class PreemptionFlag:
    """Signal handlers that only record the signal: saving inside a handler could interrupt the
    loop halfway through an optimizer step or a checkpoint write. With `interrupt`, SIGINT is
    recorded too (as an interrupt, not a preemption); with `escalate` as well, a second SIGINT
    raises KeyboardInterrupt."""

    def __init__(
        self, names: Sequence[str], interrupt: bool = False, escalate: bool = False
    ) -> None:
        self.signals = [getattr(signal, n) for n in names]
        if interrupt and signal.SIGINT not in self.signals:
            self.signals.append(signal.SIGINT)
        self.escalate = escalate
        self.received: int | None = None
        self.received_at: float | None = None
        """time.monotonic() of the first preemption signal."""
        self.interrupted_at: float | None = None
        """time.monotonic() of the first SIGINT (only recorded with `interrupt`)."""
        self.reason: str | None = None
        self._old: dict[int, Any] = {}

    def install(self) -> bool:
        if threading.current_thread() is not threading.main_thread():
            return False  # Python allows handlers only in the main thread
        for s in self.signals:
            self._old[s] = signal.signal(s, self._handler)
        return True

    def _handler(self, signum: int, _frame: object) -> None:
        if signum == signal.SIGINT:
            if self.interrupted_at is None:
                self.interrupted_at = time.monotonic()
            elif self.escalate:
                raise KeyboardInterrupt("SIGINT again")
        elif self.received is None:
            self.received = signum
            self.received_at = time.monotonic()

    def notice(self, what: str) -> None:
        """A preemption announced some other way (a cloud's metadata notice): same effect."""
        if self.received is None:
            self.reason = what
            self.received = -1
            self.received_at = time.monotonic()

    def describe(self) -> str:
        if self.reason is not None:
            return self.reason
        if self.received is not None and self.received > 0:
            return signal.Signals(self.received).name
        return "a signal on another rank"

    @property
    def requested(self) -> bool:
        """A preemption was asked on this rank (Ctrl-C is not one)."""
        return self.received is not None

    @property
    def interrupted(self) -> bool:
        return self.interrupted_at is not None

    def flags(self) -> list[float]:
        """This rank's share of the agreement collective: [preemption, interrupt]."""
        return [float(self.requested), float(self.interrupted)]

    def restore(self) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()


def agreed(summed: Sequence[float]) -> tuple[bool, bool]:
    """(preempt, interrupt) from the flags summed (or averaged) over the ranks. A preemption
    wins over a Ctrl-C on another rank: the scheduler asked for a checkpoint."""
    preempt = summed[0] > 0
    return preempt, not preempt and len(summed) > 1 and summed[1] > 0
