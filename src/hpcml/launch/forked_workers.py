"""Workers forked from the agent instead of started as new interpreters.

torchrun starts each worker of `-m hpcml ...` as `python -u -m hpcml ...`: a new interpreter
that imports torch, torch.distributed and the trainer again (2-3 CPU s per worker, paid by every
rank of every start and every elastic restart) while the agent beside it has imported them
already. On a CPU build of torch hpcml's agent (`hpcml.launch.agent`) hands torchrun's agent the
same command as a function instead, which torchrun runs with its own `fork` start method
(torch.distributed.elastic's MultiprocessContext): the worker is a child of the agent as before,
with the same environment (RANK, MASTER_ADDR, ...) and the same exit code, signals and error
files, and starts with the agent's modules already imported.

Not on a CUDA (or ROCm) build: a CUDA driver touched before a fork cannot be used in the child,
and the agent cannot know that nothing touched it. `HPCML_FORK_WORKERS=0` turns forking off,
`=1` forces it. What the fork must not carry over from the agent is undone in the child (see
`forked_worker`); what is written here by hand is only that adapter: torchrun has no option to
fork a command's workers.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import runpy
import signal
import sys
import weakref
from typing import Any

import torch

FORK_ENV = "HPCML_FORK_WORKERS"
WORKER_MODULE = "hpcml"


def forks_workers() -> bool:
    """Whether workers of `-m hpcml` are forked (see the module's docstring)."""
    choice = os.environ.get(FORK_ENV)
    if choice in ("0", "1"):
        return choice == "1"
    return torch.version.cuda is None and getattr(torch.version, "hip", None) is None


def forked_command(cmd: Any, cmd_args: list[str]) -> list[str] | None:
    """The `hpcml` arguments when torchrun was about to start `python -u -m hpcml ARGS`, else
    None (another module or script is started as torchrun would)."""
    if not isinstance(cmd, str) or cmd != os.getenv("PYTHON_EXEC", sys.executable):
        return None
    if cmd_args[:3] != ["-u", "-m", WORKER_MODULE]:
        return None
    return list(cmd_args[3:])


def forked_worker(*argv: str) -> None:
    """`python -m hpcml ARGV` in a child forked by torchrun's agent. Undone first: the agent's
    signal handlers (torchrun's raise SignalException; a worker starts with the defaults, as a
    new interpreter would), its atexit handlers and weakref finalizers (they would clean up the
    agent's things from here), its session (torchrun gives each worker a session of its own,
    and the agent's second Ctrl-C kills a worker by its process group) and its thread count
    (the agent set OMP_NUM_THREADS for the workers after torch had read it)."""
    with contextlib.suppress(OSError):
        os.setsid()
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    atexit._clear()
    # weakref.finalize's exit hook runs the finalizers still registered (a TemporaryDirectory's
    # removal): the agent's objects are the agent's to clean up, and this process must register
    # the hook again for its own.
    weakref.finalize._registry.clear()  # type: ignore[attr-defined]
    weakref.finalize._registered_with_atexit = False  # type: ignore[attr-defined]
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    sys.argv = [WORKER_MODULE, *argv]
    global _IN_FORKED_WORKER
    _IN_FORKED_WORKER = True
    # `python -m hpcml` itself, as an exec'd worker runs it: its `run` sees `in_forked_worker`
    # and ends with SystemExit (torchrun's fork start method then reports the code and ends the
    # process) instead of os._exit, which would leave the agent waiting for a return value.
    runpy.run_module(WORKER_MODULE, run_name="__main__", alter_sys=True)


_IN_FORKED_WORKER = False


def in_forked_worker() -> bool:
    """True in a worker that `forked_worker` started (read by `hpcml.cli.app.run`)."""
    return _IN_FORKED_WORKER


def install() -> None:
    """Make `torch.distributed.run` (torchrun's `run`) fork the workers of `-m hpcml`."""
    import torch._dynamo  # noqa: F401  (each worker's set-up imports it: FlopCounterMode)
    import torch.distributed.run as torchrun

    stock = torchrun.elastic_launch
    if getattr(stock, "_hpcml_forks", False):
        return

    def launch(config: Any, entrypoint: Any) -> Any:
        def start(*cmd_args: str) -> Any:
            argv = forked_command(entrypoint, list(cmd_args))
            if argv is None:
                return stock(config=config, entrypoint=entrypoint)(*cmd_args)
            config.start_method = "fork"
            return stock(config=config, entrypoint=forked_worker)(*argv)

        return start

    launch._hpcml_forks = True  # type: ignore[attr-defined]
    torchrun.elastic_launch = launch  # type: ignore[misc,assignment]
