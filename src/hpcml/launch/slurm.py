"""SLURM launch: write an sbatch script that runs `hpcml train` under torchrun on N nodes and
survives preemption, and submit it.

The script: one srun task per node starts torchrun (c10d rendezvous on the first node of the
allocation); `--signal=USR1@LEAD` makes SLURM warn the job LEAD seconds before its time limit;
torchrun's agent passes USR1 to the workers, which save a checkpoint at the next step boundary
and exit with REQUEUE_EXIT_CODE; the script then sees summary.json say "preempted" and calls
`scontrol requeue`, and the next attempt continues with `--resume auto`. Every attempt appends
to the same log file.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from hpcml import __version__
from hpcml.errors import REQUEUE_EXIT_CODE, LaunchError
from hpcml.launch.local import AGENT_SIGNALS

_TIME_RE = re.compile(r"^(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)$")


def parse_time_s(text: str) -> int:
    """SLURM's [D-]HH:MM:SS (or MM:SS) as seconds."""
    m = _TIME_RE.match(text.strip())
    if not m:
        raise LaunchError(
            f"--time {text!r} is not a SLURM time limit; write HH:MM:SS (or D-HH:MM:SS), "
            "e.g. --time 04:00:00."
        )
    days, hours, minutes, seconds = (int(g) if g else 0 for g in m.groups())
    if m.group(2) is None:  # MM:SS
        hours = 0
    if minutes >= 60 or seconds >= 60:
        raise LaunchError(f"--time {text!r} has minutes or seconds of 60 or more.")
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


@dataclass
class SlurmJob:
    config: Path
    run_dir: Path
    nodes: int
    time: str
    gpus_per_node: int = 0
    nproc_per_node: int | None = None
    """Workers per node; default one per GPU, or 1 on CPU nodes."""
    partition: str | None = None
    account: str | None = None
    cpus_per_task: int | None = None
    overrides: list[str] = field(default_factory=list)
    job_name: str | None = None
    signal_lead_s: int = 90
    max_restarts: int = 2
    """Elastic restarts inside one allocation (a worker crash restarts the group)."""
    rdzv_port: int | None = None
    """Default: 20000 + job id mod 20000, so jobs sharing a first node do not collide."""
    python: str = field(default_factory=lambda: sys.executable)
    sbatch_extra: list[str] = field(default_factory=list)
    """More `#SBATCH` lines, e.g. `--qos=high` or `--exclusive`."""

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise LaunchError(f"--nodes {self.nodes} must be at least 1.")
        if self.gpus_per_node < 0:
            raise LaunchError(f"--gpus-per-node {self.gpus_per_node} cannot be negative.")
        if self.nproc_per_node is not None and self.nproc_per_node < 1:
            raise LaunchError(f"--nproc-per-node {self.nproc_per_node} must be at least 1.")
        limit = parse_time_s(self.time)
        if self.signal_lead_s <= 0 or self.signal_lead_s >= limit:
            raise LaunchError(
                f"the warning signal {self.signal_lead_s} s before the end does not fit in "
                f"--time {self.time}; choose a longer --time or a smaller --signal-lead."
            )

    @property
    def workers_per_node(self) -> int:
        if self.nproc_per_node is not None:
            return self.nproc_per_node
        return self.gpus_per_node or 1

    @property
    def name(self) -> str:
        return self.job_name or f"hpcml-{self.config.stem}"

    @property
    def log_path(self) -> Path:
        return self.run_dir / "slurm-%j.out"


def render_sbatch(job: SlurmJob) -> str:
    q = shlex.quote
    run_dir = job.run_dir.resolve()
    directives = [
        f"--job-name={job.name}",
        f"--nodes={job.nodes}",
        "--ntasks-per-node=1",
    ]
    if job.gpus_per_node:
        directives.append(f"--gpus-per-node={job.gpus_per_node}")
    if job.cpus_per_task:
        directives.append(f"--cpus-per-task={job.cpus_per_task}")
    directives.append(f"--time={job.time}")
    if job.partition:
        directives.append(f"--partition={job.partition}")
    if job.account:
        directives.append(f"--account={job.account}")
    directives += [
        f"--signal=USR1@{job.signal_lead_s}",
        "--requeue",
        "--open-mode=append",
        f"--output={job.run_dir.resolve() / 'slurm-%j.out'}",
        *job.sbatch_extra,
    ]
    port = (
        str(job.rdzv_port) if job.rdzv_port is not None else "$(( 20000 + SLURM_JOB_ID % 20000 ))"
    )
    train_args = " ".join(
        q(a)
        for a in [
            "-m",
            "hpcml",
            "train",
            str(job.config.resolve()),
            *job.overrides,
            "--run-dir",
            str(run_dir),
            "--resume",
            "auto",
            "--quiet",
        ]
    )
    threads = max(1, (job.cpus_per_task or 1) // job.workers_per_node)
    # The agent may wait for the workers' checkpoint until shortly before SLURM's hard kill.
    shutdown_s = max(10, job.signal_lead_s - 10)
    lines = [
        "#!/bin/bash",
        f"# Written by `hpcml launch slurm` (hpcml {__version__}). Submit with: sbatch <this file>",
        f"# USR1 ({job.signal_lead_s} s before the time limit, or `scancel --signal=USR1 <job>`)"
        " makes training save a",
        f"# checkpoint and exit {REQUEUE_EXIT_CODE}; this script then requeues the job and the"
        " next attempt resumes (--resume auto).",
        *(f"#SBATCH {d}" for d in directives),
        "",
        "set -uo pipefail",
        f"RUN_DIR={q(str(run_dir))}",
        f"PYTHON={q(job.python)}",
        'mkdir -p "$RUN_DIR"',
        "attempt=$(( ${SLURM_RESTART_COUNT:-0} + 1 ))",
        'echo "[hpcml] job $SLURM_JOB_ID attempt $attempt on $SLURM_JOB_NODELIST at $(date -Is)"',
        "",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"rdzv_port={port}",
        "# torchrun's agent passes USR1 on to the workers instead of dying of it.",
        f"export PET_SIGNALS_TO_HANDLE={AGENT_SIGNALS}",
        f"export TORCHELASTIC_SIGNALS_TO_HANDLE={AGENT_SIGNALS}",
        f"export TORCH_ELASTIC_SHUTDOWN_TIMEOUT={shutdown_s}",
        f"export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-{threads}}}",
        "",
        "# summary.json newer than this marker was written by this attempt.",
        'touch "$RUN_DIR/.slurm-attempt"',
        'srun --kill-on-bad-exit=1 "$PYTHON" -m torch.distributed.run \\',
        f'    --nnodes="$SLURM_JOB_NUM_NODES" --nproc-per-node={job.workers_per_node} \\',
        '    --rdzv-backend=c10d --rdzv-endpoint="$head_node:$rdzv_port" '
        '--rdzv-id="hpcml-$SLURM_JOB_ID" \\',
        f"    --max-restarts={job.max_restarts} \\",
        f"    {train_args}",
        "rc=$?",
        'if [ "$RUN_DIR/summary.json" -nt "$RUN_DIR/.slurm-attempt" ] && '
        'grep -q \'"status": "preempted"\' "$RUN_DIR/summary.json"; then',
        '    echo "[hpcml] attempt $attempt saved a checkpoint and stopped: requeueing job '
        '$SLURM_JOB_ID"',
        '    scontrol requeue "$SLURM_JOB_ID"',
        "    exit 0",
        "fi",
        'echo "[hpcml] attempt $attempt ended with exit code $rc at $(date -Is)"',
        'exit "$rc"',
        "",
    ]
    return "\n".join(lines)


def write_script(job: SlurmJob, path: Path | None = None) -> Path:
    target = path or job.run_dir / "job.sbatch"
    target.parent.mkdir(parents=True, exist_ok=True)
    job.run_dir.mkdir(parents=True, exist_ok=True)
    target.write_text(render_sbatch(job))
    target.chmod(0o755)
    return target


def submit(script: Path) -> str:
    """`sbatch --parsable SCRIPT`; returns the job id."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise LaunchError(
            "sbatch is not on PATH; run this on a SLURM login node, or leave out --submit and "
            f"copy {script} there."
        )
    proc = subprocess.run(
        [sbatch, "--parsable", str(script)], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().splitlines()
        raise LaunchError(
            f"sbatch refused {script}: {detail[-1] if detail else 'no message'}; check the "
            "partition, account and limits."
        )
    return proc.stdout.strip().split(";")[0]
