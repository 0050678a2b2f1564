"""SLURM launch: write an sbatch script that runs `hpcml train` under torchrun on N nodes,
asks SLURM for what the workers need, survives preemption, and submit it.

The script asks for one task per node with `--cpus-per-task` cores (default: the node's cores
divided by its GPUs, times the GPUs used; read from `sinfo`), memory (`--mem`, or
`--mem-per-gpu` on GPU nodes) and `--gpus-per-node`; `srun` starts one torchrun agent per node
(c10d rendezvous on the first node), which binds each worker to the cores next to its GPU
(`torchrun --numa-binding`). `--signal=USR1@LEAD` makes SLURM warn the job LEAD seconds before
its time limit; the workers save a checkpoint at the next step boundary and exit with
REQUEUE_EXIT_CODE; the script sees this attempt's summary.json say "preempted" and requeues
the job, at most `--max-requeues` times (counted by SLURM_RESTART_COUNT). An attempt that fails
while a node of the allocation is down or drained requeues without that node (ExcNodeList).
Every attempt writes its own log, `logs/<job>[_<array task>]-r<restart>.out`; the job log
`slurm-<job>.out` gets one line per attempt and its outcome.
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
from hpcml.records import EXCLUDE_NODES

_TIME_RE = re.compile(r"^(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)$")
_MEM_RE = re.compile(r"^\d+[KMGT]?$")
_GRES_GPU_RE = re.compile(r"(?:^|,)gpu(?::[^:,(]+)?:(\d+)")
SIGNAL_MIN_START_S = 90
NUMA_MODES = ("node", "socket", "exclusive", "core-complex", "none")


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


@dataclass(frozen=True)
class NodeShape:
    """What one node of a partition offers (the smallest such node, so a request fits all)."""

    cpus: int
    mem_mb: int
    gpus: int


def parse_sinfo(text: str, gpus_wanted: int) -> NodeShape | None:
    """Lines of `sinfo -h -N -o '%c|%m|%G'`; nodes with fewer GPUs than wanted are left out."""
    shapes = []
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 3 or not parts[0].strip().isdigit():
            continue
        mem = parts[1].strip().rstrip("+")
        gpus = sum(int(g) for g in _GRES_GPU_RE.findall(parts[2]))
        if gpus < gpus_wanted:
            continue
        shapes.append(NodeShape(int(parts[0]), int(mem) if mem.isdigit() else 0, gpus))
    if not shapes:
        return None
    return NodeShape(
        min(s.cpus for s in shapes), min(s.mem_mb for s in shapes), min(s.gpus for s in shapes)
    )


def node_shape(partition: str | None, gpus_wanted: int) -> NodeShape | None:
    """Ask `sinfo` what the partition's nodes offer; None where there is no sinfo."""
    sinfo = shutil.which("sinfo")
    if sinfo is None:
        return None
    cmd = [sinfo, "-h", "-N", "-o", "%c|%m|%G", *(["-p", partition] if partition else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=60)
    return parse_sinfo(proc.stdout, gpus_wanted) if proc.returncode == 0 else None


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
    """Cores for the node's one task (its torchrun and all its workers); see `fill_from`."""
    mem: str | None = None
    """Memory per node (`--mem`, e.g. 200G); or `mem_per_gpu` on GPU nodes."""
    mem_per_gpu: str | None = None
    numa_binding: str = "node"
    """torchrun --numa-binding on GPU nodes (workers next to their GPU); "none" turns it off."""
    max_requeues: int = 3
    """Requeues of the job (preemptions, node failures) before it stops for good."""
    overrides: list[str] = field(default_factory=list)
    job_name: str | None = None
    signal_lead_s: int = 90
    max_restarts: int = 2
    """Elastic restarts inside one allocation (a worker crash restarts the group)."""
    rdzv_port: int | None = None
    """Default: 20000 + job id mod 20000, so jobs sharing a first node do not collide."""
    python: str = field(default_factory=lambda: sys.executable)
    sbatch_extra: list[str] = field(default_factory=list)
    """More `#SBATCH` lines, e.g. `--qos=high`."""
    exclusive: bool | None = None
    """Whole nodes (`--exclusive`) and cores next to the GPUs (`--gres-flags=enforce-binding`);
    None: on for multi-node GPU jobs, whose collectives another job's traffic on the same
    GPUs or network links would slow down."""

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise LaunchError(f"--nodes {self.nodes} must be at least 1.")
        if self.gpus_per_node < 0:
            raise LaunchError(f"--gpus-per-node {self.gpus_per_node} cannot be negative.")
        if self.nproc_per_node is not None and self.nproc_per_node < 1:
            raise LaunchError(f"--nproc-per-node {self.nproc_per_node} must be at least 1.")
        if self.max_requeues < 0:
            raise LaunchError(f"--max-requeues {self.max_requeues} cannot be negative.")
        if self.numa_binding not in NUMA_MODES:
            raise LaunchError(
                f"--numa-binding {self.numa_binding!r} is not one of {', '.join(NUMA_MODES)}."
            )
        for flag, value in (("--mem", self.mem), ("--mem-per-gpu", self.mem_per_gpu)):
            if value is not None and not _MEM_RE.match(value):
                raise LaunchError(
                    f"{flag} {value!r} is not a SLURM memory size; write e.g. 64G or 500M."
                )
        _check_directive_values(self)
        if self.mem is not None and self.mem_per_gpu is not None:
            raise LaunchError("give --mem or --mem-per-gpu, not both.")
        if self.mem_per_gpu is not None and not self.gpus_per_node:
            raise LaunchError("--mem-per-gpu needs --gpus-per-node; on CPU nodes use --mem.")
        if self.cpus_per_task is not None and self.cpus_per_task < self.workers_per_node:
            raise LaunchError(
                f"--cpus-per-task {self.cpus_per_task} is fewer than the "
                f"{self.workers_per_node} workers per node; give each worker at least one core."
            )
        limit = parse_time_s(self.time)
        # SLURM may send the warning up to a minute early; before the workers have installed
        # their handlers it would end them without a checkpoint.
        if self.signal_lead_s <= 0 or limit - self.signal_lead_s < SIGNAL_MIN_START_S:
            raise LaunchError(
                f"the warning signal {self.signal_lead_s} s before the end does not fit in "
                f"--time {self.time} (SLURM may send it up to 60 s early, and training must "
                f"have started: leave at least {SIGNAL_MIN_START_S} s); choose a longer --time "
                "or a smaller --signal-lead."
            )

    def fill_from(self, shape: NodeShape | None) -> None:
        """Default cores and memory from what a node offers: its cores (and memory) divided by
        its GPUs, times the GPUs this job uses; a CPU job gets the whole node."""
        if self.cpus_per_task is not None and (self.mem or self.mem_per_gpu):
            return
        if shape is None:
            raise LaunchError(
                "cannot ask sinfo what a node offers (not on a SLURM login node?); pass "
                "--cpus-per-task and --mem (or --mem-per-gpu), e.g. --cpus-per-task 64 --mem 480G."
            )
        if self.cpus_per_task is None:
            per_gpu = shape.cpus // shape.gpus if shape.gpus and self.gpus_per_node else 0
            self.cpus_per_task = per_gpu * self.gpus_per_node if per_gpu else shape.cpus
            self.cpus_per_task = max(self.cpus_per_task, self.workers_per_node)
        if not (self.mem or self.mem_per_gpu) and shape.mem_mb > 1:
            if self.gpus_per_node and shape.gpus:
                self.mem_per_gpu = f"{shape.mem_mb // shape.gpus}M"
            else:
                self.mem = f"{shape.mem_mb}M"
        self.__post_init__()

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


_WORD_RE = re.compile(r"[A-Za-z0-9_.,:+@%=/-]+")
"""What a job name, partition or account may hold: no space, quote or line break, which would
end (or add to) its `#SBATCH` line."""


def _check_directive_values(job: SlurmJob) -> None:
    """User strings written into `#SBATCH` lines: one word each, without a line break or
    anything sbatch would read as another option; refused in one sentence otherwise."""
    for flag, value in (
        ("--job-name", job.job_name),
        ("--partition", job.partition),
        ("--account", job.account),
    ):
        if value and not _WORD_RE.fullmatch(value):
            raise LaunchError(
                f"{flag} {value!r} has a character an #SBATCH line cannot hold (a space, quote, "
                "line break or other symbol); use letters, digits and _.,:+@%=/- only."
            )
    for extra in job.sbatch_extra:
        if not extra.startswith("-") or any(c in extra for c in "\n\r\x00"):
            raise LaunchError(
                f"--sbatch {extra!r} is not one sbatch option on one line; give each option "
                "as its own --sbatch, e.g. --sbatch=--qos=high."
            )
    if any(c in str(job.run_dir) for c in "\n\r\x00"):
        raise LaunchError(
            f"--run-dir {str(job.run_dir)!r} holds a line break, which an #SBATCH --output line "
            "cannot hold; choose another folder name."
        )


def _directives(job: SlurmJob) -> list[str]:
    out = [f"--job-name={job.name}", f"--nodes={job.nodes}", "--ntasks-per-node=1"]
    if job.cpus_per_task:
        out.append(f"--cpus-per-task={job.cpus_per_task}")
    if job.mem:
        out.append(f"--mem={job.mem}")
    if job.gpus_per_node:
        out.append(f"--gpus-per-node={job.gpus_per_node}")
    if job.mem_per_gpu:
        out.append(f"--mem-per-gpu={job.mem_per_gpu}")
    out.append(f"--time={job.time}")
    if job.partition:
        out.append(f"--partition={job.partition}")
    if job.account:
        out.append(f"--account={job.account}")
    out += _exclusive_flags(job)
    return [
        *out,
        f"--signal=USR1@{job.signal_lead_s}",
        "--requeue",
        "--open-mode=append",
        f"--output={job.run_dir.resolve() / 'slurm-%j.out'}",
        *job.sbatch_extra,
    ]


def _exclusive_flags(job: SlurmJob) -> list[str]:
    """`--exclusive`, and on GPU nodes `--gres-flags=enforce-binding` (see SlurmJob.exclusive)."""
    wanted = job.exclusive if job.exclusive is not None else job.nodes > 1 and job.gpus_per_node
    if not wanted:
        return []
    flags = ["--exclusive"] + ["--gres-flags=enforce-binding"] * bool(job.gpus_per_node)
    return [f for f in flags if f not in job.sbatch_extra]


def _numa(job: SlurmJob) -> bool:
    return bool(job.gpus_per_node) and job.numa_binding != "none"


def _numa_lines(job: SlurmJob) -> list[str]:
    """torchrun's --numa-binding runs the workers under numactl and fails without it: ask the
    node (the script runs on the allocation's first node) and fall back with a line in the log."""
    if not _numa(job):
        return []
    return [
        'numa_args=""',
        "if command -v numactl >/dev/null 2>&1; then",
        f'    numa_args="--numa-binding={job.numa_binding}"',
        "else",
        '    say "numactl is not installed on $(hostname): workers start without '
        f'--numa-binding={job.numa_binding}"',
        "fi",
    ]


def _launch_lines(job: SlurmJob) -> list[str]:
    """srun: one task per node with all its cores; torchrun (through hpcml's agent, which ends
    the group without a restart or a traceback on a preemption) starts the workers."""
    q = shlex.quote
    train_args = " ".join(
        q(a)
        for a in [
            "-m", "hpcml", "train", str(job.config.resolve()), *job.overrides,
            "--run-dir", str(job.run_dir.resolve()), "--resume", "auto", "--quiet",
        ]
    )  # fmt: skip
    numa = " $numa_args" if _numa(job) else ""  # empty where the node has no numactl
    cpus = f" --cpus-per-task={job.cpus_per_task}" if job.cpus_per_task else ""
    return [
        # srun does not inherit --cpus-per-task from sbatch in SLURM 22.05-23.02: say it again.
        f'srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1{cpus} --kill-on-bad-exit=1 \\',
        '    "$PYTHON" -m hpcml.launch.agent \\',
        f'    --nnodes="$SLURM_JOB_NUM_NODES" --nproc-per-node={job.workers_per_node}{numa} \\',
        '    --rdzv-backend=c10d --rdzv-endpoint="$head_node:$rdzv_port" '
        '--rdzv-id="hpcml-$SLURM_JOB_ID" \\',
        f"    --max-restarts={job.max_restarts} \\",
        f"    {train_args}",
        "rc=$?",
    ]


def _requeue_without_lines() -> list[str]:
    """A shell function that requeues the job leaving out the nodes in $1 (comma-separated)
    besides those it already left out."""
    return [
        "requeue_without() {",
        '    excluded=$(scontrol -o show job "$SLURM_JOB_ID" | tr " " "\\n" '
        "| sed -n 's/^ExcNodeList=//p')",
        '    nodes="$1"',
        '    [ -n "$excluded" ] && [ "$excluded" != "(null)" ] && nodes="$excluded,$nodes"',
        "    # A running job's ExcNodeList cannot change: hold it pending first. slurmctld",
        "    # may apply the requeue after scontrol returns (seen under load: the update and",
        "    # release came first and the job stayed held), so wait until it is pending; this",
        "    # script outlives the requeue's SIGTERM (trapped) for KillWait.",
        '    scontrol requeuehold "$SLURM_JOB_ID" || return 1',
        "    for _ in $(seq 100); do",
        '        scontrol -o show job "$SLURM_JOB_ID" | grep -q "JobState=PENDING" && break',
        "        sleep 0.2",
        "    done",
        '    scontrol update JobId="$SLURM_JOB_ID" ExcNodeList="$nodes"',
        '    scontrol release "$SLURM_JOB_ID"',
        "}",
    ]


def _outcome_lines(job: SlurmJob) -> list[str]:
    """After srun: requeue a preempted attempt (up to --max-requeues); requeue a failed one
    without its broken node(s); otherwise end with the attempt's exit code. Either requeue
    also leaves out the nodes training listed as persistent stragglers (`EXCLUDE_NODES`)."""
    n = job.max_requeues
    return [
        *_requeue_without_lines(),
        f'slow=$(tr -d " \\n" < "$RUN_DIR/{EXCLUDE_NODES}" 2>/dev/null)',
        'if [ "$RUN_DIR/summary.json" -nt "$ATTEMPT_MARK" ] && '
        'grep -q \'"status": "preempted"\' "$RUN_DIR/summary.json"; then',
        '    if [ "$got_term" -eq 1 ]; then',
        '        say "attempt $attempt saved a checkpoint and stopped on SIGTERM (scancel, time '
        'limit or a preemption by SLURM): not requeueing it here"',
        f"        exit {REQUEUE_EXIT_CODE}",
        "    fi",
        f'    if [ "$restarts" -ge {n} ]; then',
        '        say "attempt $attempt saved a checkpoint and stopped; the job was requeued '
        f'$restarts times (--max-requeues {n}): not requeueing; resubmit this script to continue"',
        f"        exit {REQUEUE_EXIT_CODE}",
        "    fi",
        '    if [ -n "$slow" ]; then',
        '        say "attempt $attempt saved a checkpoint and stopped: requeueing job '
        '$SLURM_JOB_ID without persistent straggler node(s) $slow"',
        '        requeue_without "$slow" && exit 0',
        "    else",
        '        say "attempt $attempt saved a checkpoint and stopped: requeueing job $SLURM_JOB_ID"',
        '        scontrol requeue "$SLURM_JOB_ID" && exit 0',
        "    fi",
        '    say "the job cannot be requeued (cancelled?)"',
        f"    exit {REQUEUE_EXIT_CODE}",
        "fi",
        'if [ "$rc" -ne 0 ]; then',
        '    bad=$(sinfo -h -N -n "$SLURM_JOB_NODELIST" -t down,drain,drained,draining,fail,'
        "no_respond -o %N 2>/dev/null | sort -u | paste -sd, -)",
        f'    if [ -n "$bad" ] && [ "$restarts" -lt {n} ]; then',
        '        say "attempt $attempt failed (exit $rc) on unhealthy node(s) $bad: requeueing '
        'job $SLURM_JOB_ID without them${slow:+ and without persistent straggler node(s) $slow}"',
        '        requeue_without "$bad${slow:+,$slow}"',
        "        exit 0",
        "    fi",
        "fi",
        'say "attempt $attempt ended with exit code $rc"',
        'exit "$rc"',
    ]


def render_sbatch(job: SlurmJob) -> str:
    q = shlex.quote
    run_dir = job.run_dir.resolve()
    port = (
        str(job.rdzv_port) if job.rdzv_port is not None else "$(( 20000 + SLURM_JOB_ID % 20000 ))"
    )
    threads = max(1, (job.cpus_per_task or 1) // job.workers_per_node)
    # The agent may wait for the workers' checkpoint until shortly before SLURM's hard kill.
    shutdown_s = max(10, job.signal_lead_s - 10)
    n = job.max_requeues
    lines = [
        "#!/bin/bash",
        f"# Written by `hpcml launch slurm` (hpcml {__version__}). Submit with: sbatch <this file>",
        f"# USR1 ({job.signal_lead_s} s before the time limit, or `scancel --signal=USR1 <job>`)"
        " makes training save a",
        f"# checkpoint and exit {REQUEUE_EXIT_CODE}; this script then requeues the job (at most"
        f" {n} times) and the next",
        "# attempt resumes (--resume auto).",
        *(f"#SBATCH {d}" for d in _directives(job)),
        "",
        "set -uo pipefail",
        f"RUN_DIR={q(str(run_dir))}",
        f"PYTHON={q(job.python)}",
        'mkdir -p "$RUN_DIR/logs"',
        "restarts=${SLURM_RESTART_COUNT:-0}",
        "attempt=$(( restarts + 1 ))",
        'job_tag="${SLURM_ARRAY_JOB_ID:+${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}}"',
        'job_tag="${job_tag:-$SLURM_JOB_ID}"',
        'JOB_LOG="$RUN_DIR/slurm-$SLURM_JOB_ID.out"',
        'ATTEMPT_LOG="$RUN_DIR/logs/$job_tag-r$restarts.out"',
        'say() { echo "[hpcml] $(date -Is) $*" | tee -a "$ATTEMPT_LOG" >> "$JOB_LOG"; }',
        'say "job $job_tag attempt $attempt on $SLURM_JOB_NODELIST: log $ATTEMPT_LOG"',
        'exec >> "$ATTEMPT_LOG" 2>&1',
        f'if [ "$restarts" -gt {n} ]; then',
        f'    say "the job was requeued $restarts times, more than --max-requeues {n}: '
        'not starting"',
        "    exit 1",
        "fi",
        "# SIGTERM (scancel, the time limit, a preemption by another job) ends srun's tasks;",
        "# this script stays to say how, and leaves requeueing to SLURM (or the user's cancel).",
        "got_term=0",
        "trap 'got_term=1; say \"SIGTERM: the workers save a checkpoint within the grace time\"' TERM",
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
        'ATTEMPT_MARK="$RUN_DIR/logs/.attempt-$job_tag-r$restarts"',
        'touch "$ATTEMPT_MARK"',
        *_numa_lines(job),
        *_launch_lines(job),
        *_outcome_lines(job),
        "",
    ]
    return "\n".join(lines)


def render_tune_sbatch(job: SlurmJob, workers: int, tune_args: list[str]) -> str:
    """A job array of `workers` tasks, each one `hpcml tune` worker on one node (its trials on
    `workers_per_node` processes) on the study in `job.run_dir`: they share its storage (the
    journal file there, on a shared filesystem, or `--storage` in `tune_args`) like the
    workers of one `hpcml tune --workers W`, and the array task id numbers each worker so that
    their samplers differ. A task that ends early (scancel, a failed node) leaves its trial
    running in the study; the next worker fails it and queues it again."""
    q = shlex.quote
    run_dir = job.run_dir.resolve()
    skip = ("--signal=", "--requeue", "--open-mode=", "--output=")
    directives = [d for d in _directives(job) if not d.startswith(skip)]
    directives += [f"--array=0-{workers - 1}", f"--output={run_dir / 'slurm-%A_%a.out'}"]
    tune = " ".join(
        q(a)
        for a in [
            "-m", "hpcml", "tune", str(job.config.resolve()), *job.overrides,
            "--out", str(run_dir), "--workers", "1", "--nproc", str(job.workers_per_node),
            *tune_args,
        ]
    )  # fmt: skip
    threads = max(1, (job.cpus_per_task or 1) // job.workers_per_node)
    return "\n".join(
        [
            "#!/bin/bash",
            f"# Written by `hpcml launch slurm --tune-workers {workers}` (hpcml {__version__}): "
            f"{workers} tune workers",
            "# (a job array) on one study. Submit with: sbatch <this file>",
            *(f"#SBATCH {d}" for d in directives),
            "",
            "set -uo pipefail",
            f"export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-{threads}}}",
            f'exec {q(job.python)} {tune} --first-worker "$SLURM_ARRAY_TASK_ID" --json',
            "",
        ]
    )


def write_script(job: SlurmJob, path: Path | None = None, text: str | None = None) -> Path:
    target = path or job.run_dir / "job.sbatch"
    target.parent.mkdir(parents=True, exist_ok=True)
    job.run_dir.mkdir(parents=True, exist_ok=True)
    target.write_text(render_sbatch(job) if text is None else text)
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
