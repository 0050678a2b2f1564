"""`hpcml` commands for the tests, each in a process of its own forked from a server that imported
torch and hpcml once (multiprocessing's forkserver with preloaded modules), instead of a new
interpreter that imports them again.

Why: a `python -m hpcml train` spends 2-3 CPU seconds importing torch, torch.distributed and
hpcml before its first line of work, and the suite runs a few hundred such commands on 2 cores
(`tests/cpu_report.py` shows where the suite's CPU goes). multiprocessing's forkserver is the
standard library's own way to start many processes from one that has imported a set of modules;
what is written here is only the part no library does: running the `hpcml` command line in the
forked process with the test's argv, environment, working folder and captured output, and giving
back what `subprocess.run` would (exit code, stdout, stderr, a timeout).

What differs from `python -m hpcml`, and why it does not matter to the tests that use it:
- the modules in PRELOAD were imported under the environment the pytest worker started with;
  hpcml reads its variables (HPCML_*, RANK, ...) when a command runs, not at import, and the
  forked process gets the test's environment before the command starts. The thread count torch
  read at import is set again from the test's OMP_NUM_THREADS.
- the process is the forkserver's child, not the test's, and runs in the server's process group:
  tests that signal a process group, read a command line, or need to be the parent (kill -9 and
  signal tests) start `python -m hpcml` with `subprocess` themselves, as they already do.
- `python -m` puts the working folder first on sys.path; so does the forked process.
Workers, agents and servers a command starts are new interpreters as always (sys.executable).

`HPCML_TEST_FORK=0` runs every command in a new interpreter instead (a check that nothing
depends on the shortcut); `run_hpcml(..., fresh=True)` does so for one command.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

PRELOAD = ["torch", "torch._dynamo", "hpcml.cli.app", "hpcml.train.entry", "hpcml.train.trainer"]
"""What every `hpcml train` imports (torch._dynamo: the set-up's model check, FlopCounterMode)."""
ENABLED = os.environ.get("HPCML_TEST_FORK", "1") != "0"

forked_cpu_s = 0.0
"""CPU seconds (user + system, the commands and the children they waited for) of every forked
command so far: they are not this process's children, so RUSAGE_CHILDREN does not count them;
the CPU record in tests/conftest.py adds this."""

_context: mp.context.ForkServerContext | None = None
_cpu_lock = threading.Lock()


def kill_tree(proc: Any) -> None:
    """SIGKILL to a forked command and everything it started (torchrun's workers have sessions
    of their own, so only their ancestry finds them)."""
    import psutil

    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()
    proc.kill()


def add_cpu(usage: str) -> None:
    """Adds the CPU seconds a forked command wrote to `usage` as it ended."""
    global forked_cpu_s
    with contextlib.suppress(FileNotFoundError, ValueError):
        seconds = float(Path(usage).read_text())
        with _cpu_lock:
            forked_cpu_s += seconds


def server_context() -> mp.context.ForkServerContext:
    """multiprocessing's forkserver context with PRELOAD imported in the server (one server
    per process: `start_method="forkserver"` elsewhere in this process gets the same one)."""
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context



def start_ranks(worker: Any, args: tuple[Any, ...], nprocs: int = 2) -> None:
    """torch's `start_processes(worker, args, nprocs)` with the processes forked from this
    module's pre-imported server (not spawned: no second import of torch), each under this
    process's environment rather than the server's (an earlier test started it). Joins them."""
    import torch.multiprocessing as torch_mp

    server_context()
    env = dict(os.environ)
    torch_mp.start_processes(
        _in_env, args=(worker, env, args), nprocs=nprocs, join=True, start_method="forkserver"
    )


def _in_env(rank: int, worker: Any, env: dict[str, str], args: tuple[Any, ...]) -> None:
    os.environ.clear()
    os.environ.update(env)
    worker(rank, *args)


Stdio = str | Any
"""A path to write (stdout, stderr) or a descriptor passed on (multiprocessing.reduction.DupFd)."""


def _attach(stdio: tuple[Stdio, Stdio, Stdio]) -> None:
    for fd, where in enumerate(stdio):
        if where is None:
            target = os.open(os.devnull, os.O_RDONLY)
        elif isinstance(where, str):
            target = os.open(where, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        else:
            target = where.detach()
        os.dup2(target, fd)
        os.close(target)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 (fd 0, closed at exit)


def _command(
    argv: list[str], cwd: str, env: dict[str, str], stdio: tuple[Stdio, Stdio, Stdio], usage: str
) -> None:
    """Runs in the forked process: `python -m hpcml ARGV` from here on, then exits with its code."""
    import atexit
    import traceback

    _attach(stdio)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    if env.get("OMP_NUM_THREADS", "").isdigit():
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.path.insert(0, cwd)
    sys.argv = [str(Path(__file__).resolve().parents[1] / "src" / "hpcml" / "__main__.py"), *argv]

    def record_cpu() -> None:
        t = os.times()
        Path(usage).write_text(repr(t.user + t.system + t.children_user + t.children_system))

    # `run` ends the process itself (hpcml.cli.app.exit_now: threads joined, atexit run,
    # streams flushed, os._exit); the CPU record is written by an atexit handler of its own.
    atexit.register(record_cpu)
    from hpcml.cli.app import exit_now, run

    try:
        run()
    except BaseException:  # what escaped run: the interpreter prints it and exits 1
        traceback.print_exc()
    exit_now(1)


def run(
    argv: list[str], cwd: Path, env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    """`subprocess.run([sys.executable, "-m", "hpcml", *argv], capture_output=True, text=True,
    ...)`, in a forked process (see the module docstring)."""
    cmd = [sys.executable, "-m", "hpcml", *argv]
    with tempfile.TemporaryDirectory(prefix="hpcml-fork-") as tmp:
        out, err, usage = (os.path.join(tmp, n) for n in ("out", "err", "usage"))
        stdio = (None, out, err)
        proc = server_context().Process(target=_command, args=(argv, str(cwd), env, stdio, usage))
        proc.start()
        proc.join(timeout)
        timed_out = proc.exitcode is None
        if timed_out:
            kill_tree(proc)
            proc.join()

        def read(path: str) -> str:
            try:
                return Path(path).read_text(errors="replace")
            except FileNotFoundError:
                return ""

        stdout, stderr = read(out), read(err)
        add_cpu(usage)
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr)
    assert proc.exitcode is not None
    return subprocess.CompletedProcess(cmd, proc.exitcode, stdout, stderr)
