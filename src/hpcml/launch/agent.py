"""torchrun (torch.distributed.run), run for `hpcml train --nproc N` and `launch slurm`, with
what hpcml needs from its agent:

- a failed group ends with the first failed worker's exit code (not torchrun's ChildFailedError
  traceback and exit 1), and what failed (rank, exit code) is written as JSON for the
  `hpcml train` parent, which turns it into one sentence;
- a worker that exits with REQUEUE_EXIT_CODE saved a checkpoint on a preemption signal: the
  agent ends the group there and exits with that code, instead of spending an elastic restart
  (`--max-restarts`) to train on as if nothing had been asked; likewise exit 130 (SIGINT to a
  worker, which every rank stops on at the same step);
- a signal the agent handles itself (SIGTERM/SIGUSR1 from SLURM, SIGINT) is passed on to the
  workers by torchrun as usual; it then ends with one line and exit code 128 + signal instead
  of a SignalException traceback in every preempted attempt's log; a second Ctrl-C kills the
  workers at once (`SignalGate`).

- on a CPU build of torch the workers of `-m hpcml` are forked from this process instead of
  started as new interpreters (`hpcml.launch.forked_workers`).

The agent's own log lines are silenced unless HPCML_AGENT_LOGS=1; workers' output passes through.
Same arguments as torchrun: `python -m hpcml.launch.agent --nproc-per-node 2 -m hpcml train ...`
(`hpcml train --nproc N` calls `main` in its own process: `hpcml.launch.local.run_torchrun`).
The agent class is torchrun's LocalElasticAgent with `_monitor_workers` (the hook
SimpleElasticAgent subclasses implement) extended; torchrun builds its agent by that name in
torch.distributed.launcher.api, where it is replaced for this process.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed.launcher.api as launcher_api
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from hpcml.distributed.runtime import AGENT_ENV
from hpcml.distributed.runtime import WORKER_ERRORS_ENV as ERRORS_ENV
from hpcml.errors import REQUEUE_EXIT_CODE
from hpcml.launch.forked_workers import forks_workers
from hpcml.launch.forked_workers import install as install_forked_workers


def exit_code_of(code: int) -> int:
    """A worker killed by signal N reports -N; a shell would say 128 + N."""
    return code if code >= 0 else 128 - code


def preempted(failures: dict[int, Any]) -> bool:
    """Whether any failed worker exited with the requeue code (it saved and stopped)."""
    return any(getattr(f, "exitcode", None) == REQUEUE_EXIT_CODE for f in failures.values())


INTERRUPTED_EXIT_CODE = 130
"""A worker's exit code after Ctrl-C (SIGINT), which every rank acts on at the same step."""


def stopped_on_purpose(failures: dict[int, Any]) -> bool:
    """A preemption (saved, exit 75) or Ctrl-C (exit 130): an elastic restart would undo it."""
    codes = {getattr(f, "exitcode", None) for f in failures.values()}
    return bool(codes & {REQUEUE_EXIT_CODE, INTERRUPTED_EXIT_CODE})


DUPLICATE_S = 1.0
"""A second death signal this soon after the first is the same request delivered twice."""


class SignalGate:
    """torchrun's handler raises SignalException on every death signal, also on one that comes
    while the agent is already stopping the workers for the first. The same signal can reach the
    agent twice (from the process group and from a launcher that forwards it: `srun`, or
    `hpcml train` when it ran the agent as a child process); the second broke off the shutdown
    that passed SIGINT on, and torchrun's clean-up then sent SIGTERM, which
    workers take for a preemption (seen in CI). The gate's handler raises for the first signal,
    ignores others while the workers are being stopped for it or within DUPLICATE_S of it, and,
    should the first exception have been lost inside torchrun (the agent still not stopping
    after DUPLICATE_S + 0.5 s), delivers the signal to the agent again.

    Workers stop on Ctrl-C at their next step boundary; a worker that never reaches one (a
    hang, a very long step) would keep the agent waiting TORCH_ELASTIC_SHUTDOWN_TIMEOUT. A
    second Ctrl-C, DUPLICATE_S or more after the first, kills the workers at once (`force`),
    as a second Ctrl-C does in most tools."""

    def __init__(self) -> None:
        self.handling_since: float | None = None
        self.stopping = False
        self.force: Callable[[], None] | None = None
        """Set by the agent: SIGKILL to every worker's process group."""

    def reset(self) -> None:
        """New workers (first start or elastic restart): no signal is being handled."""
        self.handling_since, self.stopping = None, False

    def install(self) -> None:
        names = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT")
        for name in names.split(","):
            sig = getattr(signal, name.strip(), None)
            if sig is not None and callable(signal.getsignal(sig)):  # torchrun installed one
                signal.signal(sig, self.handle)

    def handle(self, signum: int, _frame: Any) -> None:
        now = time.monotonic()
        if self.handling_since is not None:
            again = now - self.handling_since >= DUPLICATE_S
            if self.stopping and again and signum == signal.SIGINT and self.force is not None:
                self.force()
                return
            if self.stopping or not again:
                return
        self.handling_since = now
        retry = threading.Timer(DUPLICATE_S + 0.5, self._again, (signum,))
        retry.daemon = True
        retry.start()
        raise SignalException(f"Process {os.getpid()} got signal: {signum}", signal.Signals(signum))

    def _again(self, signum: int) -> None:
        if not self.stopping:
            os.kill(os.getpid(), signum)


GATE = SignalGate()


class PreemptionAwareAgent(LocalElasticAgent):
    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        ids = super()._start_workers(worker_group)
        GATE.reset()
        GATE.force = self._kill_workers
        GATE.install()
        return ids

    def _kill_workers(self) -> None:
        """A second Ctrl-C: SIGKILL to each worker's process group (torchrun starts each worker
        in a session of its own), which ends the shutdown's wait for them at once."""
        context = getattr(self, "_pcontext", None)
        if context is None:
            return
        os.write(2, b"[hpcml] torchrun agent: got SIGINT again: killing the workers now\n")
        for pid in context.pids().values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        if GATE.handling_since is not None:
            GATE.stopping = True  # stopping the workers for the signal being handled
        super()._shutdown(death_sig, timeout)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = super()._monitor_workers(worker_group)
        if result.state == WorkerState.FAILED and stopped_on_purpose(result.failures):
            self._remaining_restarts = 0  # a preemption or Ctrl-C is not a crash: no restart
        return result


def _say(message: str) -> None:
    print(f"[hpcml] torchrun agent: {message}", file=sys.stderr, flush=True)


def _signal_name(code: int) -> str | None:
    if code >= 0:
        return None
    try:
        return signal.Signals(-code).name
    except ValueError:
        return None


def _report_failure(exc: ChildFailedError) -> int:
    rank, first = exc.get_first_failure()
    failures = [
        {"rank": r, "exit_code": exit_code_of(f.exitcode), "signal": _signal_name(f.exitcode)}
        for r, f in sorted(exc.failures.items())
    ]
    folder = os.environ.get(ERRORS_ENV)
    if folder:
        record = {"first_rank": rank, "failures": failures}
        (Path(folder) / "agent.json").write_text(json.dumps(record))
    elif os.environ.get("HPCML_AGENT_LOGS") == "1":
        print(exc.format_msg(), file=sys.stderr, flush=True)  # torchrun's failure report
    return exit_code_of(first.exitcode) or 1


def main(argv: list[str] | None = None) -> int:
    if os.environ.get("HPCML_AGENT_LOGS") != "1":
        # torch.multiprocessing.spawn: forked workers (hpcml.launch.forked_workers) are closed
        # through it, with a warning per worker stopped.
        for name in ("torch.distributed.elastic", "torch.multiprocessing.spawn"):
            quiet = logging.getLogger(name)
            quiet.propagate = False
            quiet.addHandler(logging.NullHandler())
    from torch.distributed.run import parse_args, run

    launcher_api.LocalElasticAgent = PreemptionAwareAgent  # type: ignore[misc]
    if forks_workers():
        install_forked_workers()
    os.environ[AGENT_ENV] = "1"  # the workers know their errors end here as one line
    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
    except ChildFailedError as exc:
        if preempted(exc.failures):
            _say(f"the workers saved a checkpoint and stopped; exit code {REQUEUE_EXIT_CODE}")
            return REQUEUE_EXIT_CODE
        return _report_failure(exc)
    except SignalException as exc:
        name = signal.Signals(exc.sigval).name
        _say(f"got {name} and passed it on to the workers; they have stopped")
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
