"""The parent of one trial's run: `python -I .../guard.py COMMAND...` (run as a script, so it
imports only the standard library and starts in milliseconds).

Why a trial's run is not the tuner's own child: the tuner ties its runs to itself with Linux's
parent-death signal (SIGINT: the run stops at a step boundary and writes its summary). That
signal is sent each time a *thread* holding the child exits, and a tuner killed with kill -9
has several threads (Optuna's heartbeat, SQLAlchemy's, BLAS's): as each dies in turn, the
children pass to a surviving sibling thread and get the signal again. A run that got SIGINT
twice or three times (measured: 1 to 3 for a parent with 9 threads) treats the second as a
user's second Ctrl-C (stop now, `escalate`) and the third can land while it writes its
summary: under load, the killed tuner's run ended with no summary.json.

This process has one thread. It dies with the tuner (SIGKILL, however many times it comes),
and its one exit gives the run exactly one SIGINT. A SIGINT or SIGTERM it gets (the tuner
pruning the trial) is passed on to the run; it exits as the run did.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGINT) -> None:
    """Ask Linux to send `sig` to this process when its parent dies (no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def main(command: list[str]) -> int:
    parent = os.getppid()
    die_with_parent(signal.SIGKILL)
    if os.getppid() != parent:  # the tuner died before the line above: nothing to run for
        return 1
    guard = os.getpid()

    def tie() -> None:
        die_with_parent(signal.SIGINT)
        if os.getppid() != guard:  # this guard died before the line above
            os._exit(130)

    proc = subprocess.Popen(command, preexec_fn=tie)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: proc.send_signal(signum))
    rc = proc.wait()
    if rc < 0:  # killed by a signal: end the same way, so the tuner sees what the run saw
        if -rc not in (signal.SIGKILL, signal.SIGSTOP):  # these two have no handler
            signal.signal(-rc, signal.SIG_DFL)
        os.kill(os.getpid(), -rc)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
