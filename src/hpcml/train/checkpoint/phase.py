"""Which phase of a checkpoint save each thread of this process is in, and since when.

A save goes write -> hash -> (wait) -> fsync -> manifest -> rename -> prune; a background save runs its
later phases in a writer thread. The watchdog (hpcml.train.fault.guard) reads `longest()` to end a
save stalled in one phase (a hung filesystem) with a sentence naming the rank and the phase,
instead of pausing while the save never returns. Fault drills stall a phase through `hook`.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

PHASES = ("write", "hash", "wait", "fsync", "manifest", "rename", "prune", "read")
"""`wait` is a rank waiting at a barrier for the others (usually for rank 0's finalize);
`read` is a load (resume or rollback: verification and the read of every file)."""


@dataclass(frozen=True)
class Phase:
    name: str
    step: int
    started: float
    """time.monotonic() when it began."""
    save_started: float | None = None
    """time.monotonic() when the `write` phase of this step's save began (a background
    save's later phases begin well after it)."""

    def elapsed_s(self, now: float | None = None) -> float:
        return (time.monotonic() if now is None else now) - self.started


_active: dict[int, Phase] = {}
_saves: dict[int, float] = {}
"""step -> time.monotonic() when its save's `write` phase began."""
_tokens = itertools.count()
_lock = threading.Lock()
hook: Callable[[str, int], None] | None = None
"""Called as each phase begins (after it is registered, so a stall in it is a stalled phase)."""


def begin(name: str, step: int) -> int:
    token = next(_tokens)
    now = time.monotonic()
    with _lock:
        if name == "write" or step not in _saves:
            _saves[step] = now
            while len(_saves) > 8:  # only the saves in flight matter
                del _saves[min(_saves)]
        _active[token] = Phase(name, step, now, _saves[step])
    if hook is not None:
        hook(name, step)
    return token


def end(token: int) -> None:
    with _lock:
        _active.pop(token, None)


def point(name: str, step: int) -> None:
    """A point inside a phase where a fault drill may strike (`renamed`: the folder renamed
    into place, its parent not yet fsynced; `pruning`: an old checkpoint's manifest removed,
    its files not yet)."""
    if hook is not None:
        hook(name, step)


@contextlib.contextmanager
def phase(name: str, step: int) -> Iterator[None]:
    token = begin(name, step)
    try:
        yield
    finally:
        end(token)


def longest(include_wait: bool = True) -> Phase | None:
    """The phase in progress that began first (None when no save is under way)."""
    with _lock:
        phases = [p for p in _active.values() if include_wait or p.name != "wait"]
    return min(phases, key=lambda p: p.started) if phases else None
