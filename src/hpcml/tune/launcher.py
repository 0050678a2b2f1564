"""A warm launcher of trial runs: one process per tune worker that imports torch and the trainer
once, then forks each trial's `hpcml train` instead of starting a fresh interpreter (measured in
benchmarks/tune.py: the start of a fresh run is several CPU seconds of imports, which pruning a
short trial cannot save).

The chain a run hangs from keeps hpcml.tune.guard's promise, exactly one SIGINT for a run whose
tuner is killed with kill -9:

    tuner worker -> launcher -> guard -> run
                  SIGKILL     SIGKILL   SIGINT    (each one's parent-death signal)

The launcher has threads (BLAS pools started by numpy's import), so it is not the run's parent:
for each trial it forks a guard, a copy of one thread (fork copies only the calling thread),
which forks the run. The guard dies with the launcher, however many of its threads exit in
turn, and its one exit gives the run one SIGINT. The launcher never runs a torch operation, so
no OpenMP pool or device context is forked; a run imports what it needs beyond the preloaded
modules itself. A command that is not this interpreter's `-m hpcml` is exec'ed by the run, as
subprocess would.

Protocol, one JSON object a line. Tuner to launcher: `{"command": [...], "log": PATH}` starts a
run (stdout and stderr to PATH), `{"signal": N}` sends N to its guard (which passes SIGINT and
SIGTERM on). Launcher to tuner: `{"ready": true}` once warm, `{"pid": N}` (the guard) and
`{"returncode": N}` when the guard has ended, as the run did. The tuner closing the pipe ends it.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from hpcml.config import RunConfig
from hpcml.tune import guard

PRELOAD = (
    "torch",
    "hpcml.__main__",
    "hpcml.cli.app",
    "hpcml.train.entry",
    "hpcml.train.trainer",
    "hpcml.train.validate",
    "hpcml.data.sources",
)
"""Imported once by the launcher: what every `hpcml train` run imports."""


def preload_for(cfg: RunConfig) -> tuple[str, ...]:
    """PRELOAD and what runs of `cfg` import besides (`?`: when installed): MLflow is seconds
    of a tracked run's start."""
    extra: tuple[str, ...] = ("?mlflow",) if cfg.tracking.backend == "mlflow" else ()
    return PRELOAD + extra


READY_WAIT_S = 600.0
"""A launcher that has not imported its modules this long after its start is given up."""


class Lines:
    """JSON lines read from a file descriptor; a line still being written waits."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buffer = b""

    def read(self) -> list[dict[str, Any]] | None:
        """The complete lines now readable (blocks until some bytes are); None at end of file."""
        data = os.read(self.fd, 65536)
        if not data:
            return None
        *lines, self.buffer = (self.buffer + data).split(b"\n")
        return [json.loads(line) for line in lines if line.strip()]


def send(fd: int, message: dict[str, Any]) -> None:
    os.write(fd, (json.dumps(message) + "\n").encode())


# --- the launcher process -------------------------------------------------------------------


def main(argv: list[str]) -> int:
    """`python -m hpcml.tune.launcher TUNER_PID MODULE...`, its protocol on stdin and stdout."""
    die_with(int(argv[0]), signal.SIGKILL)
    fin, fout = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(2, 1)  # a stray print of an import goes to stderr, not into the protocol
    os.close(devnull)
    for name in argv[1:]:
        if name.startswith("?"):
            with contextlib.suppress(ImportError):
                importlib.import_module(name[1:])
        else:
            importlib.import_module(name)
    send(fout, {"ready": True})
    command = serve(fin, fout)
    return 0 if command is None else run(command)


def die_with(parent: int, sig: int) -> None:
    """Get `sig` when `parent` dies; if it is already gone, exit now."""
    guard.die_with_parent(sig)
    if os.getppid() != parent:
        os._exit(1)


def serve(fin: int, fout: int) -> list[str] | None:
    """Start runs as asked until the tuner closes the pipe (None). Returns, in a run's
    process only, the command it is to run."""
    lines = Lines(fin)
    child: tuple[int, int] | None = None  # the guard's pid and pidfd
    while True:
        ready, _, _ = select.select([fin] + ([child[1]] if child else []), [], [])
        if child is not None and child[1] in ready:  # reaped only here: a signal sent
            _, status = os.waitpid(child[0], 0)  # before this reaches the guard, not a new pid
            os.close(child[1])
            send(fout, {"returncode": os.waitstatus_to_exitcode(status)})
            child = None
        if fin not in ready:
            continue
        messages = lines.read()
        if messages is None:
            return None  # a guard still running dies with this process
        for message in messages:
            if "signal" in message and child is not None:
                os.kill(child[0], int(message["signal"]))
            elif "command" in message:
                launcher = os.getpid()
                pid = os.fork()
                if pid == 0:
                    os.close(fin)
                    os.close(fout)
                    return guard_run(launcher, message["command"], message["log"])
                child = (pid, os.pidfd_open(pid))
                send(fout, {"pid": pid})


def guard_run(launcher: int, command: list[str], log: str) -> list[str]:
    """In the forked guard (one thread): fork the run, pass it SIGINT and SIGTERM, end as it
    did (os._exit: nothing of the launcher's runs here). Returns only in the run."""
    os.setsid()  # as the cold guard: the terminal's Ctrl-C is the tuner's to pass on
    die_with(launcher, signal.SIGKILL)
    me = os.getpid()
    run_pid: list[int] = []
    pending: list[int] = []

    def forward(signum: int, _frame: Any) -> None:
        if run_pid:
            os.kill(run_pid[0], signum)
        else:
            pending.append(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    pid = os.fork()
    if pid == 0:
        die_with(me, signal.SIGINT)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(devnull)
        os.close(out)
        return command
    os.close(out)
    run_pid.append(pid)
    for signum in pending:
        os.kill(pid, signum)
    _, status = os.waitpid(pid, 0)  # a forwarded signal's handler runs, and it waits on
    rc = os.waitstatus_to_exitcode(status)
    if rc < 0:  # killed by a signal: end the same way, so the tuner sees what the run saw
        if -rc not in (signal.SIGKILL, signal.SIGSTOP):  # these two have no handler
            signal.signal(-rc, signal.SIG_DFL)
        os.kill(os.getpid(), -rc)
    os._exit(rc)


def run(command: list[str]) -> int:
    """In the run's process: this interpreter's `-m hpcml ...` runs here, on the preloaded
    modules, as `python -m hpcml` would; anything else is exec'ed."""
    if command[:3] != [sys.executable, "-m", "hpcml"]:
        os.execv(command[0], command)
    sys.argv = ["hpcml", *command[3:]]
    try:
        runpy.run_module("hpcml", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException:
        traceback.print_exc()
        code = 1
    # `python -m hpcml` ends the process itself (hpcml.cli.app.exit_now); what escaped it ends
    # here the same way: threading's exit hooks and joins (idle thread pools are told to stop
    # first), the exit handlers, then os._exit without the teardown of every module.
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


# --- the tuner's end ------------------------------------------------------------------------


class Launcher:
    """The tuner worker's handle on its launcher. Start it from the thread that runs the
    trials: the launcher dies with that thread."""

    def __init__(self, preload: tuple[str, ...] = PRELOAD) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hpcml.tune.launcher", str(os.getpid()), *preload],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            start_new_session=True,  # the terminal's Ctrl-C is the tuner's to pass on
        )  # fmt: skip
        assert self.proc.stdout is not None
        self.lines = Lines(self.proc.stdout.fileno())
        self.ready = False
        self.current: WarmProcess | None = None

    @staticmethod
    def supported() -> bool:
        return sys.platform.startswith("linux") and hasattr(os, "pidfd_open")

    def start(self, command: list[str], log: Path) -> WarmProcess:
        if self.proc.poll() is not None:
            raise RuntimeError(f"the trial launcher exited (code {self.proc.returncode})")
        self.send({"command": command, "log": str(log)})
        deadline = time.monotonic() + READY_WAIT_S
        self.current = proc = WarmProcess(self)
        while proc.pid == 0:
            if not self.pump(max(0.0, deadline - time.monotonic())):
                raise RuntimeError("the trial launcher ended before it started the run")
            if time.monotonic() > deadline:
                raise RuntimeError("the trial launcher did not start the run in time")
        return proc

    def send(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(message) + "\n").encode())
        self.proc.stdin.flush()

    def pump(self, timeout: float) -> bool:
        """Read what the launcher said within `timeout` seconds; False once it has ended
        (its run's guard then died with it: the run got SIGINT)."""
        ready, _, _ = select.select([self.lines.fd], [], [], timeout)
        if not ready:
            return True
        messages = self.lines.read()
        if messages is None:
            if self.current is not None and self.current.returncode is None:
                self.current.returncode = -signal.SIGKILL
            return False
        for message in messages:
            self.ready = self.ready or bool(message.get("ready"))
            if self.current is not None and "pid" in message:
                self.current.pid = int(message["pid"])
            if self.current is not None and "returncode" in message:
                self.current.returncode = int(message["returncode"])
        return True

    def close(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


class OnDemand:
    """A tune worker's launcher, started when the worker starts its first run (a worker that
    finds the study full or whose trials are all infeasible starts none: its imports cost
    about what one fresh run's do). None where fork and pidfds are not Linux's."""

    def __init__(self, preload: tuple[str, ...]) -> None:
        self.preload = preload
        self.launcher: Launcher | None = None

    def get(self) -> Launcher | None:
        if self.launcher is None and Launcher.supported():
            self.launcher = Launcher(self.preload)
        return self.launcher

    def close(self) -> None:
        if self.launcher is not None:
            self.launcher.close()
            self.launcher = None


class WarmProcess:
    """A run started by a Launcher, with the part of subprocess.Popen's interface that
    hpcml.tune.trial uses (the pid is its guard's)."""

    def __init__(self, launcher: Launcher) -> None:
        self.launcher = launcher
        self.pid = 0
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.launcher.pump(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = 1.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(f"trial run {self.pid}", timeout or 0.0)
            self.launcher.pump(min(left, 1.0))
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            self.launcher.send({"signal": int(sig)})

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
