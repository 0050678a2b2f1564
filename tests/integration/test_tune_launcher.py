"""The warm launcher (hpcml.tune.launcher) as the tuner sees a run through it: the run's exit
code or killing signal, its output in the log, SIGINT passed on, and `-m hpcml` run in the
forked process. The launchers here preload nothing (the runs are stand-ins), so each test
costs a fraction of a second; the real trials through it are tests/integration/test_tune.py's.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hpcml.tune import guard
from hpcml.tune.launcher import Launcher

pytestmark = pytest.mark.skipif(not Launcher.supported(), reason="Linux only (pidfd_open)")

WAIT_S = 60.0
"""Bound on a stand-in run (each ends in well under a second; fails instead of hanging)."""


@pytest.fixture
def launcher():
    launcher = Launcher(preload=())
    yield launcher
    launcher.close()


def test_the_runs_exit_code_and_output_come_back_one_run_after_another(
    launcher: Launcher, tmp_path: Path
):
    # Two runs in turn on one launcher: each code and log is that run's own.
    for code in (3, 0):
        log = tmp_path / f"run-{code}.log"
        script = f"import sys; print('run {code}'); sys.exit({code})"
        proc = launcher.start([sys.executable, "-c", script], log)
        assert proc.wait(WAIT_S) == code
        assert log.read_text() == f"run {code}\n"


@pytest.mark.parametrize("start", ["warm", "cold"])
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_run_killed_by_a_signal_ends_as_killed_by_it(
    launcher: Launcher, tmp_path: Path, start: str, sig: int
):
    # Both guards, the launcher's and the fresh one (a run the kernel's OOM killer ends
    # must not look like a run that failed with exit code 1).
    command = [sys.executable, "-c", f"import os; os.kill(os.getpid(), {int(sig)})"]
    if start == "warm":
        proc: Any = launcher.start(command, tmp_path / "run.log")
    else:
        proc = subprocess.Popen([sys.executable, "-I", guard.__file__, *command])
    assert proc.wait(WAIT_S) == -sig


def test_sigint_to_the_run_reaches_it_once(launcher: Launcher, tmp_path: Path):
    ready = tmp_path / "ready"
    script = (
        "import signal, sys, time\n"
        "from pathlib import Path\n"
        "got = []\n"
        "signal.signal(signal.SIGINT, lambda *_: got.append(1))\n"
        f"Path({str(ready)!r}).write_text('1')\n"
        "while not got: time.sleep(0.01)\n"
        "time.sleep(0.2)\n"  # a second SIGINT, if one came, is counted too
        "sys.exit(10 + len(got))\n"
    )
    proc = launcher.start([sys.executable, "-c", script], tmp_path / "run.log")
    deadline = time.monotonic() + WAIT_S
    while not ready.exists():
        assert proc.poll() is None, (tmp_path / "run.log").read_text()
        assert time.monotonic() < deadline, "the run did not start"
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(WAIT_S) == 11


def test_python_m_hpcml_runs_with_its_exit_code_and_output(launcher: Launcher, tmp_path: Path):
    log = tmp_path / "run.log"
    proc = launcher.start([sys.executable, "-m", "hpcml", "train", "--help"], log)
    assert proc.wait(WAIT_S) == 0
    assert "Train a model from a YAML config" in log.read_text()
    # A command line typer refuses: its exit code (2) and message, as from `python -m hpcml`.
    proc = launcher.start([sys.executable, "-m", "hpcml", "train", "--no-such-option"], log)
    assert proc.wait(WAIT_S) == 2
    assert "No such option" in log.read_text()
