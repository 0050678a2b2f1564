"""The generated sbatch script leaves out the nodes training listed as persistent stragglers
(RUN_DIR/exclude_nodes, written by hpcml.train.fault.straggler; tests/integration/
test_straggler_tp.py) when it requeues the job: after a preempted attempt, and, with the
unhealthy nodes, after a failed one.

The script runs in bash as written; srun, scontrol and sinfo are small stand-ins on PATH that
play one attempt (srun writes what training would leave) and record how they were called. The
real SLURM path of the same `requeue_without` (hold, update ExcNodeList, release) is run by
tests/e2e/test_slurm.py's failed-node test.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from hpcml.launch.slurm import SlurmJob, write_script

JOB_ID = "42"

STUBS = {
    # One attempt of training: RC_TO_LEAVE and, when preempted, the summary it would write.
    "srun": """#!/bin/bash
[ -n "$LEAVE_SUMMARY" ] && echo "$LEAVE_SUMMARY" > "$RUN_DIR_FOR_STUB/summary.json"
exit "$RC_TO_LEAVE"
""",
    "scontrol": """#!/bin/bash
echo "scontrol $*" >> "$CALLS"
case "$*" in
  "show hostnames"*) echo node-a ;;
  "-o show job"*) echo "JobId=$SLURM_JOB_ID JobState=PENDING ExcNodeList=(null)" ;;
esac
""",
    "sinfo": """#!/bin/bash
echo "$UNHEALTHY"
""",
}


def _run(tmp_path: Path, slow: str | None, rc: int, unhealthy: str = "") -> tuple[str, str]:
    run_dir = tmp_path / "run"
    script = write_script(
        SlurmJob(config=tmp_path / "c.yaml", nodes=1, time="01:00:00", run_dir=run_dir)
    )
    if slow is not None:
        (run_dir / "exclude_nodes").write_text(slow)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in STUBS.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    calls = tmp_path / "calls"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": JOB_ID,
        "SLURM_JOB_NODELIST": "node-a",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_RESTART_COUNT": "0",
        "CALLS": str(calls),
        "RUN_DIR_FOR_STUB": str(run_dir),
        "RC_TO_LEAVE": str(rc),
        "LEAVE_SUMMARY": '{"status": "preempted"}' if rc == 75 else "",
        "UNHEALTHY": unhealthy,
    }
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, timeout=60)
    assert done.returncode == 0, done
    log = (run_dir / f"slurm-{JOB_ID}.out").read_text()
    return calls.read_text(), log


def test_a_preempted_attempt_is_requeued_without_the_persistent_stragglers(
    tmp_path: Path,
) -> None:
    calls, log = _run(tmp_path, slow="node-b7\n", rc=75)
    assert f"scontrol requeuehold {JOB_ID}" in calls
    assert f"scontrol update JobId={JOB_ID} ExcNodeList=node-b7" in calls
    assert f"scontrol release {JOB_ID}" in calls
    assert f"requeueing job {JOB_ID} without persistent straggler node(s) node-b7" in log


def test_without_stragglers_a_preempted_attempt_is_requeued_as_it_was(tmp_path: Path) -> None:
    calls, _ = _run(tmp_path, slow=None, rc=75)
    assert f"scontrol requeue {JOB_ID}" in calls and "ExcNodeList" not in calls


@pytest.mark.parametrize("slow", ["node-b7\n", None])
def test_a_failed_attempt_leaves_out_unhealthy_nodes_and_stragglers(
    tmp_path: Path, slow: str | None
) -> None:
    calls, log = _run(tmp_path, slow=slow, rc=1, unhealthy="node-c")
    want = "node-c,node-b7" if slow else "node-c"
    assert f"scontrol update JobId={JOB_ID} ExcNodeList={want}\n" in calls
    assert f"on unhealthy node(s) node-c: requeueing job {JOB_ID} without them" in log
