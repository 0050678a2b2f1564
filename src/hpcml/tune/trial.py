"""One trial: a real `hpcml train` process in its own run folder, watched while it runs.

The tuner reads the run's `run.jsonl` as the run appends to it: each evaluation record is
reported to the study (Optuna's intermediate values), and when the pruner says stop, the run
gets SIGINT, which `hpcml train` acts on at the next step boundary (on every rank with
`--nproc`), writing no checkpoint; the folder's `trial.json` then says `pruned`. A run that has
trained its last step is not stopped: it is complete, with its final evaluation. The process
is tied to the tuner through a one-thread parent (hpcml.tune.guard, Linux's parent-death
signal): a tuner killed with kill -9 leaves no training behind, and the run gets one SIGINT.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from hpcml.errors import ConfigError
from hpcml.records import RUN_LOG, SUMMARY
from hpcml.tune import guard
from hpcml.tune.launcher import Launcher

TRIAL_FILE = "trial.json"
"""What the tuner says of the run in its folder: study, trial number, parameters, status."""
LOG_FILE = "train.log"
"""The run's stdout and stderr."""
POLL_S = 0.05
"""How often the tuner reads new records (a read of a few appended lines)."""
STOP_WAIT_S = 120.0
"""A pruned run that has not stopped at a step boundary this long after SIGINT is killed."""


@dataclass
class Outcome:
    """How a trial ended: `complete` (value), `pruned` (at `step`) or `failed` (`error`);
    `steps`: the training steps the run took (its last step record)."""

    state: str
    value: float | None = None
    step: int = 0
    error: str | None = None
    curve: list[tuple[int, float]] = field(default_factory=list)
    steps: int = 0
    eval_samples: int | None = None
    """The samples its last evaluation scored (`val_samples`): what the value's precision
    rests on. None when the metric is a named eval set's, whose record does not count them."""


class RecordTail:
    """The records appended to a run.jsonl since the last read; a line still being written
    (no newline yet) waits for the next read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.buffer = b""

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        lines = (self.buffer + data).split(b"\n")
        self.buffer = lines.pop()
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out


def train_command(config: Path, overrides: list[str], run_dir: Path, nproc: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "hpcml",
        "train",
        str(config),
        *overrides,
        "--run-dir",
        str(run_dir),
        "--nproc",
        str(nproc),
        "--quiet",
    ]


def _last_error(log: Path) -> str:
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no output"
    return lines[-1][:300] if lines else "no output"


class Process(Protocol):
    """What the tuner uses of a run's process: subprocess.Popen's or a WarmProcess's."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def kill(self) -> None: ...


def _start(command: list[str], run_dir: Path, launcher: Launcher | None) -> Process:
    """The run under a guard that dies with the tuner: forked from the warm launcher, or a
    fresh `python -I guard.py COMMAND` (see the module docstring)."""
    if launcher is not None:
        return launcher.start(command, run_dir / LOG_FILE)
    with open(run_dir / LOG_FILE, "wb") as log:
        return subprocess.Popen(
            # -I: the guard imports only the standard library, not modules beside its file.
            [sys.executable, "-I", guard.__file__, *command],  # dies with the tuner (its doc)
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,  # the terminal's Ctrl-C is the tuner's to pass on
        )  # fmt: skip


def _stop(proc: Process) -> None:
    """SIGINT (the run stops at a step boundary, its folder consistent); SIGKILL if it hangs."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(STOP_WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run(
    command: list[str],
    run_dir: Path,
    metric: str,
    report: Callable[[list[tuple[int, float]]], bool],
    last_step: int,
    heartbeat: Callable[[], None] = lambda: None,
    heartbeat_s: float = 5.0,
    launcher: Launcher | None = None,
) -> Outcome:
    """Run `command` (an `hpcml train` writing into `run_dir`, `last_step` steps) and pass each
    evaluation's `metric` to `report([(step, value), ...])`, which returns True to prune the
    trial there. Evaluations that arrived together are reported in one call (asking the pruner
    costs a read of the study, and a tuner that asked once per evaluation fell behind a fast
    run). A run that ends before the answer is complete, whatever the answer; so is one that
    has trained its last step (a verdict at its final evaluation saves no step: stopped in its
    last moments, it ended `interrupted` with all its training done and was recorded pruned)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    tail = RecordTail(run_dir / RUN_LOG)
    curve: list[tuple[int, float]] = []
    steps = 0
    samples: int | None = None

    def read() -> list[dict[str, Any]]:
        nonlocal steps, samples
        records = tail.read()
        steps = max([steps] + [int(r["step"]) for r in records if r.get("kind") == "step"])
        for r in records:
            if r.get("kind") == "eval" and "/" not in metric and "val_samples" in r:
                samples = int(r["val_samples"])
        return records

    proc = _start(command, run_dir, launcher)
    beat = time.monotonic()
    try:
        while True:
            done = proc.poll() is not None
            points = _eval_points(read(), metric, proc)
            curve += points
            trained = max(steps, points[-1][0] if points else 0) >= last_step
            if points and report(points) and not done and not trained:
                _stop(proc)
                late = _eval_points(read(), metric, proc)  # what it did before it stopped
                curve += late
                if not _ended(run_dir, curve, last_step):  # it may have finished meanwhile
                    value, step = points[-1][1], points[-1][0]
                    return Outcome("pruned", value, step, curve=curve, steps=steps)
                if late:
                    report(late)
                done = True
            if done:
                break
            if time.monotonic() - beat >= heartbeat_s:
                heartbeat()
                beat = time.monotonic()
            time.sleep(POLL_S)
    except BaseException:  # Ctrl-C or an error of the tuner: leave no run behind
        if proc.poll() is None:
            _stop(proc)
        raise
    assert proc.returncode is not None
    outcome = _finished(proc.returncode, run_dir, metric, curve, last_step)
    outcome.steps, outcome.eval_samples = steps, samples
    return outcome


def _ended(run_dir: Path, curve: list[tuple[int, float]], last_step: int) -> bool:
    """Whether the run finished, or evaluated its last step (a SIGINT that came after it then
    stopped only the writing of its summary: `interrupted`, its training done)."""
    return _status(run_dir) == "finished" or bool(curve and curve[-1][0] >= last_step)


def _eval_points(
    records: list[dict[str, Any]], metric: str, proc: Process
) -> list[tuple[int, float]]:
    points = []
    for rec in records:
        if rec.get("kind") != "eval":
            continue
        if metric not in rec:
            _stop(proc)
            known = ", ".join(k for k in rec if k.startswith("val_"))
            raise ConfigError(
                f"tune.metric '{metric}' is not among the metrics an evaluation reports "
                f"({known}); set tune.metric to one of them."
            )
        points.append((int(rec.get("step", 0)), float(rec[metric])))
    return points


def _summary(run_dir: Path) -> dict[str, Any]:
    try:
        data = json.loads((run_dir / SUMMARY).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _status(run_dir: Path) -> str | None:
    return _summary(run_dir).get("status")


def _finished(
    rc: int, run_dir: Path, metric: str, curve: list[tuple[int, float]], last_step: int
) -> Outcome:
    """A run that wrote its finished summary is complete, even if a SIGINT sent as it ended
    made its exit code 130; so is one interrupted after it evaluated its last step, with
    that evaluation's value."""
    summary = _summary(run_dir)
    if summary.get("status") == "interrupted" and _ended(run_dir, curve, last_step):
        return Outcome("complete", curve[-1][1], curve[-1][0], curve=curve)
    if summary.get("status") != "finished":
        return Outcome("failed", error=f"exit code {rc}: {_last_error(run_dir / LOG_FILE)}")
    final = summary.get("final") or {}
    value = final.get(metric, curve[-1][1] if curve else None)
    if value is None:
        return Outcome("failed", error=f"the run reported no {metric}")
    step = curve[-1][0] if curve else 0
    return Outcome("complete", float(value), step, curve=curve)


def write_trial_file(run_dir: Path, info: dict[str, Any]) -> None:
    write_trial_file_at(run_dir / TRIAL_FILE, info)


def write_trial_file_at(path: Path, info: dict[str, Any]) -> None:
    from hpcml.records import write_json_atomic

    write_json_atomic(path, info)


def worker_identity() -> dict[str, Any]:
    """This process as the study records it: a trial whose worker is gone is failed by the
    next worker on the host (kill -9, a crash), without waiting for the heartbeat's grace."""
    return {"host": os.uname().nodename, "pid": os.getpid(), "started": process_start(os.getpid())}


def process_start(pid: int) -> str | None:
    """The kernel's start time of `pid` (field 22 of /proc/PID/stat): a pid reused by another
    process has another start time. None when the process does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def worker_alive(identity: dict[str, Any]) -> bool | None:
    """Whether the worker that runs a trial is alive; None when it is on another host."""
    if identity.get("host") != os.uname().nodename:
        return None
    start = process_start(int(identity.get("pid", -1)))
    return start is not None and start == identity.get("started")
