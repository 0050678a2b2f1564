"""End to end on a real single-node SLURM cluster: `hpcml launch slurm --submit`, preempt the
running job with `scancel --signal=USR1`, and check that it checkpoints, is requeued, resumes
and finishes with the same losses as a run that was never stopped."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from slurm_cluster import SlurmCluster, why_unavailable

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    reason = why_unavailable()
    if reason:
        pytest.skip(reason)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except RuntimeError as exc:
        cluster.stop()
        pytest.skip(f"the SLURM daemons cannot run here: {str(exc)[:500]}")
    yield cluster
    cluster.stop()


def env(cluster: SlurmCluster) -> dict[str, str]:
    # sbatch exports this environment to the job, so its workers find the same code and use
    # one thread each like the reference run (same summation order, same bits).
    return {**cluster.env, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}


def step_losses(run_dir: Path) -> dict[int, float]:
    out = {}
    for line in (run_dir / "run.jsonl").read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("kind", "step") == "step":
            out[int(rec["step"])] = rec["loss"]
    return out


def wait(what: str, predicate: Any, cluster: SlurmCluster, timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}\n{cluster.logs()}")


def test_preempted_job_checkpoints_is_requeued_and_finishes_like_an_uninterrupted_run(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    config = tmp_path / "mlp.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {"name": "mlp", "args": {"hidden": 64}},
                "data": {"source": "digits", "batch_size": 16, "limit_train": 256},
                "optim": {"lr": 0.003, "warmup_steps": 5},
                "train": {
                    "max_steps": 200,
                    "eval_every": 0,
                    "checkpoint_every": 50,
                    "log_every": 1,
                    "device": "cpu",
                },
            }
        )
    )
    # The uninterrupted reference runs beside the job (not under SLURM).
    ref_dir = tmp_path / "ref"
    reference = subprocess.Popen(
        [sys.executable, "-m", "hpcml", "train", str(config), "--run-dir", str(ref_dir), "--quiet"],
        env=env(slurm),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )

    run_dir = tmp_path / "run"
    launched = subprocess.run(
        [
            sys.executable, "-m", "hpcml", "launch", "slurm", str(config),
            "--nodes", "1", "--time", "00:10:00", "--run-dir", str(run_dir),
            "--submit", "--json",
        ],
        env=env(slurm),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert launched.returncode == 0, launched.stderr
    job_id = json.loads(launched.stdout)["job_id"]
    assert job_id

    # Preempt once training is well under way (past its first checkpoint at step 50).
    wait("60 steps", lambda: (run_dir / "run.jsonl").exists() and len(step_losses(run_dir)) >= 60,
         slurm)
    slurm.run("scancel", "--signal=USR1", job_id)

    # The job saves, stops with the requeue code and requeues itself. SLURM holds a requeued
    # job for two minutes (its BeginTime), so that the first attempt is gone and its revoked
    # credential (revocation is kept with one-second resolution) cannot refuse the second.
    # To keep the test short: wait until the first attempt's batch step is gone, let those
    # seconds pass, and release the job.
    wait(
        "the requeue",
        lambda: (s := slurm.job_state(job_id)).get("Restarts", "0") != "0"
        and s.get("JobState") == "PENDING"
        and not slurm.batch_step_alive(job_id),
        slurm,
    )
    time.sleep(2.5)
    slurm.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
    state = wait(
        "the job to complete",
        lambda: (s := slurm.job_state(job_id)).get("JobState") in ("COMPLETED", "FAILED",
                                                                    "CANCELLED", "TIMEOUT") and s,
        slurm,
        timeout=150,
    )
    log = (run_dir / f"slurm-{job_id}.out").read_text()
    assert state["JobState"] == "COMPLETED", log
    assert state["Restarts"] == "1"

    # One log across both attempts: the preemption, the requeue, the resume.
    assert "attempt 1" in log and "attempt 2" in log, log
    assert "preempted by SIGUSR1" in log
    assert "requeueing job" in log
    events = [
        json.loads(line) for line in (run_dir / "run.jsonl").read_text().splitlines()
        if '"kind": "fault"' in line
    ]
    (preempted,) = [e for e in events if e["event"] == "preempted"]
    # >= 60: signalled after 60 logged steps; < 200: handled before the last step (max_steps).
    assert preempted["signal"] == "SIGUSR1" and 60 <= preempted["step"] < 200

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == 200
    assert summary["resumed_from"] == str(run_dir / "checkpoints" / f"step-{preempted['step']}")

    assert reference.wait(timeout=120) == 0, reference.stderr.read() if reference.stderr else ""
    expected = step_losses(ref_dir)
    got = step_losses(run_dir)
    assert sorted(got) == list(range(1, 201))
    assert got == expected  # every step, bit for bit, across the preemption
    ref_final = json.loads((ref_dir / "summary.json").read_text())["final"]
    assert summary["final"] == ref_final
