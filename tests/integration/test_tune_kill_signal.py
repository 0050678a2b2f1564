"""A trial's run gets one SIGINT when its tuner dies, however many threads the tuner has
(hpcml.tune.guard).

Linux sends a child its parent-death signal each time the thread holding it exits: when a
tuner is killed with kill -9 its threads exit one after another, the child passes to a sibling
thread at each exit and gets SIGINT again (measured 1 to 3 times with 9 threads, as the kernel
orders the exits). A run that was the tuner's own child took the second SIGINT for a user's
second Ctrl-C and a third could stop it while it wrote its summary: the kill -9 tune test saw
runs end with no summary.json.

The kernel's order is made certain here: the tuner's thread that started the run exits first
(pthread_exit, its siblings alive), and only then is the tuner killed. The run is a stand-in
that counts the SIGINTs it gets until its parent is gone. Both ways a run starts are checked:
a fresh `python -I guard.py` per trial, and forked from the warm launcher
(hpcml.tune.launcher), which has threads of its own (numpy's BLAS pool) and dies with the
thread that started it.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.conftest import ROOT, hpcml_env

WAIT_S = 60.0
"""Bound on waiting for a file another process writes (fails the test instead of hanging)."""

RUN = r"""
import os, signal, sys, time
from pathlib import Path
out = Path(sys.argv[1])
got = []
def handler(*_):
    got.append(1)
    (out / "signalled").write_text(str(len(got)))
signal.signal(signal.SIGINT, handler)
parent = os.getppid()
(out / "ready").write_text(str(os.getpid()))
while os.getppid() == parent:  # reparented out of the tuner: every signal has been sent
    time.sleep(0.01)
time.sleep(0)  # a bytecode boundary: Python runs the handlers of signals already delivered
(out / "count").write_text(str(len(got)))
"""

TUNER = r"""
import ctypes, sys, threading
from pathlib import Path
from hpcml.tune import trial
from hpcml.tune.launcher import Launcher
out = Path(sys.argv[1])
for _ in range(4):  # a tuner's other threads: heartbeat, database, BLAS pools
    threading.Thread(target=threading.Event().wait, daemon=True).start()
def beat():
    if (out / "ready").exists():  # the run is up: this thread, its parent, ends first
        ctypes.CDLL(None).pthread_exit(None)
def start():
    # numpy: a launcher with threads, as the real one has (the run must not be their child)
    launcher = Launcher(preload=("numpy",)) if sys.argv[3] == "warm" else None
    trial.run([sys.executable, "-c", sys.argv[2], str(out)], out / "run", "val_loss",
              lambda points: False, 1, heartbeat=beat, heartbeat_s=0.0, launcher=launcher)
threading.Thread(target=start).start()
threading.Event().wait()
"""


def _wait_file(path: Path) -> str:
    deadline = time.monotonic() + WAIT_S
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, f"gave up waiting for {path}"
        time.sleep(0.02)
    return path.read_text()


@pytest.mark.parametrize("start", ["cold", "warm"])
def test_a_run_gets_one_sigint_as_its_tuners_threads_exit_in_turn(tmp_path: Path, start: str):
    tuner = subprocess.Popen(
        [sys.executable, "-c", TUNER, str(tmp_path), RUN, start], cwd=ROOT, env=hpcml_env()
    )
    try:
        # The first SIGINT: the thread that started the run has exited (the tuner lives on).
        _wait_file(tmp_path / "signalled")
    finally:
        tuner.kill()  # then the rest of the tuner's threads
        tuner.wait()
    assert _wait_file(tmp_path / "count") == "1"
