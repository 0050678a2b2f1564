"""Local multi-process launch: start torchrun's elastic agent (torch.distributed.run, through
`hpcml.launch.agent`, which reports failures without torchrun's traceback) with
`--nproc-per-node N` running `python -m hpcml train ...` in each worker.

A worker that stops on an `HpcmlError` writes its sentence and exit code to
`$HPCML_WORKER_ERRORS/rank-R.json`; `worker_error` reads them back for the parent."""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcml.distributed.runtime import AGENT_ENV
from hpcml.distributed.runtime import WORKER_ERRORS_ENV as ERRORS_ENV
from hpcml.errors import LaunchError


def max_local_procs() -> tuple[int, str]:
    """How many worker processes this machine can run: one per GPU, else one per CPU core."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count(), "GPUs"
    except ImportError:
        pass
    return os.cpu_count() or 1, "CPU cores"


def check_nproc(nproc: int) -> None:
    if nproc < 1:
        raise LaunchError(f"--nproc {nproc} must be at least 1.")
    limit, unit = max_local_procs()
    if nproc > limit:
        raise LaunchError(
            f"--nproc {nproc} is more than this machine can run ({limit} {unit}); "
            f"use --nproc {limit} or fewer, or launch on more machines (hpcml launch slurm)."
        )


AGENT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def preemption_env(shutdown_timeout_s: int = 120) -> dict[str, str]:
    """Environment for torchrun's agent: also pass SIGUSR1 on to the workers (SLURM's warning
    signal; left out, it kills the agent), and give the workers time to reach a step boundary
    and save before the agent sends SIGKILL. Variables rather than flags, so an older torchrun
    ignores them instead of failing."""
    return {
        "PET_SIGNALS_TO_HANDLE": AGENT_SIGNALS,
        "TORCHELASTIC_SIGNALS_TO_HANDLE": AGENT_SIGNALS,
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(shutdown_timeout_s),
    }


def torchrun_args(nproc: int, worker_args: list[str], max_restarts: int = 0) -> list[str]:
    """torchrun's arguments (hpcml.launch.agent takes the same) for `python -m hpcml WORKER_ARGS`
    in each of `nproc` local workers."""
    return [
        "--standalone",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        "-m",
        "hpcml",
        *worker_args,
    ]


def run_torchrun(
    nproc: int,
    worker_args: list[str],
    max_restarts: int = 0,
    errors_dir: Path | None = None,
) -> int:
    """Run the workers to completion under torchrun's agent (`hpcml.launch.agent`, the torchrun
    that ends the group on a preemption), in this process: `hpcml train` has imported torch
    already, and a separate agent process would import it again (~2 CPU s per launch) only to
    wait. The agent handles SIGTERM/SIGINT/SIGUSR1 itself and passes them on to the workers.
    With `errors_dir`, workers and agent leave what failed there (see `worker_error`). The
    environment and signal handlers are restored afterwards."""
    env = {ERRORS_ENV: str(errors_dir)} if errors_dir is not None else {}
    # torchrun warns and sets 1 when unset; split the cores between workers instead.
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    env.update(preemption_env())
    saved_env = {k: os.environ.get(k) for k in (*env, AGENT_ENV)}
    handled = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)
    saved_handlers = {s: signal.getsignal(s) for s in handled}
    os.environ.update(env)
    try:
        from hpcml.launch.agent import main as agent_main

        return agent_main(torchrun_args(nproc, worker_args, max_restarts))
    finally:
        for s, h in saved_handlers.items():
            signal.signal(s, h)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclass
class WorkerFailure:
    rank: int
    exit_code: int
    sentence: str | None
    """The worker's own one sentence (an HpcmlError), or None when it died otherwise."""
    how: str
    """'exited with code N' or 'was killed by SIGNAL'."""


def worker_error(errors_dir: Path) -> WorkerFailure | None:
    """What the workers and agent left in `errors_dir`: the lowest rank's sentence, else the
    first failed rank and its exit code (or signal)."""
    sentences = []
    for path in sorted(errors_dir.glob("rank-*.json")):
        try:
            rec = json.loads(path.read_text())
            sentences.append((int(rec["rank"]), int(rec["exit_code"]), str(rec["message"])))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    if sentences:
        rank, code, message = min(sentences)
        return WorkerFailure(rank, code, message, f"exited with code {code}")
    try:
        agent: dict[str, Any] = json.loads((errors_dir / "agent.json").read_text())
        first = next(f for f in agent["failures"] if f["rank"] == agent["first_rank"])
    except (OSError, ValueError, KeyError, TypeError, StopIteration):
        return None
    how = (
        f"was killed by {first['signal']}"
        if first.get("signal")
        else f"exited with code {first['exit_code']}"
    )
    return WorkerFailure(int(first["rank"]), int(first["exit_code"]), None, how)
