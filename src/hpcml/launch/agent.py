"""torchrun (torch.distributed.run) with the two things a preemption needs from its agent:

- a worker that exits with REQUEUE_EXIT_CODE saved a checkpoint on a preemption signal: the
  agent ends the group there and exits with that code, instead of spending an elastic restart
  (`--max-restarts`) to train on as if nothing had been asked;
- a signal the agent handles itself (SIGTERM/SIGUSR1 from SLURM, SIGINT) is passed on to the
  workers by torchrun as usual; it then ends with one line and exit code 128 + signal instead
  of a SignalException traceback in every preempted attempt's log.

Same arguments as torchrun: `python -m hpcml.launch.agent --nproc-per-node 2 -m hpcml train ...`.
The agent class is torchrun's LocalElasticAgent with `_monitor_workers` (the hook
SimpleElasticAgent subclasses implement) extended; torchrun builds its agent by that name in
torch.distributed.launcher.api, where it is replaced for this process.
"""

from __future__ import annotations

import signal
import sys
from typing import Any

import torch.distributed.launcher.api as launcher_api
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from hpcml.errors import REQUEUE_EXIT_CODE


def preempted(failures: dict[int, Any]) -> bool:
    """Whether any failed worker exited with the requeue code (it saved and stopped)."""
    return any(getattr(f, "exitcode", None) == REQUEUE_EXIT_CODE for f in failures.values())


class PreemptionAwareAgent(LocalElasticAgent):
    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = super()._monitor_workers(worker_group)
        if result.state == WorkerState.FAILED and preempted(result.failures):
            self._remaining_restarts = 0  # a preemption is not a crash: no elastic restart
        return result


def _say(message: str) -> None:
    print(f"[hpcml] torchrun agent: {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.run import parse_args, run

    launcher_api.LocalElasticAgent = PreemptionAwareAgent  # type: ignore[misc]
    try:
        run(parse_args(argv))
    except ChildFailedError as exc:
        if preempted(exc.failures):
            _say(f"the workers saved a checkpoint and stopped; exit code {REQUEUE_EXIT_CODE}")
            return REQUEUE_EXIT_CODE
        print(exc.format_msg(), file=sys.stderr, flush=True)  # torchrun's failure report
        return 1
    except SignalException as exc:
        name = signal.Signals(exc.sigval).name
        _say(f"got {name} and passed it on to the workers; they have stopped")
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
