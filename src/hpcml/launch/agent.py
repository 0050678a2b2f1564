"""torchrun's elastic agent, run for `hpcml train --nproc N`, reporting failures quietly.

Plain torchrun ends a failed group with its own ChildFailedError traceback and exit code 1,
whatever the workers said. Here the agent runs the same code (torch.distributed.run), but a
failure ends with the first failed worker's exit code, and what failed (rank, exit code) is
written as JSON for the `hpcml train` parent, which turns it into one sentence. The agent's
log lines are silenced unless HPCML_AGENT_LOGS=1; workers' own output passes through unchanged.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from pathlib import Path

from hpcml.distributed.runtime import WORKER_ERRORS_ENV as ERRORS_ENV


def exit_code_of(code: int) -> int:
    """A worker killed by signal N reports -N; a shell would say 128 + N."""
    return code if code >= 0 else 128 - code


def main(argv: list[str] | None = None) -> None:
    if os.environ.get("HPCML_AGENT_LOGS") != "1":
        quiet = logging.getLogger("torch.distributed.elastic")
        quiet.propagate = False
        quiet.addHandler(logging.NullHandler())
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run(args)
    except ChildFailedError as exc:
        rank, first = exc.get_first_failure()
        failures = [
            {"rank": r, "exit_code": exit_code_of(f.exitcode), "signal": _signal_name(f.exitcode)}
            for r, f in sorted(exc.failures.items())
        ]
        folder = os.environ.get(ERRORS_ENV)
        if folder:
            record = {"first_rank": rank, "failures": failures}
            (Path(folder) / "agent.json").write_text(json.dumps(record))
        sys.exit(exit_code_of(first.exitcode) or 1)


def _signal_name(code: int) -> str | None:
    if code >= 0:
        return None
    try:
        return signal.Signals(-code).name
    except ValueError:
        return None


if __name__ == "__main__":
    main()
