"""End to end on a real single-node SLURM cluster (slurmctld + slurmd from Debian's slurm-wlm):
`hpcml launch slurm --submit`, then what a cluster does to a job: `scancel --signal=USR1`
(checkpoint, requeue, resume, same losses as a run never stopped), the real time limit with
`--signal=USR1@N` (and --max-requeues), plain `scancel` (SIGTERM, then SIGKILL after the grace
time), a node that fails (requeued without it); and the resources the script asks for, as the
scheduler sees them (`scontrol show job`).

Under CI=true these tests fail instead of skipping when SLURM cannot run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest
import yaml
from slurm_cluster import SlurmCluster, why_unavailable

from hpcml.errors import REQUEUE_EXIT_CODE
from hpcml.train.checkpoint import store as ckpt

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def unavailable(reason: str) -> NoReturn:
    """Skip on a developer's machine; fail under CI (CI=true), which must run this test."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI=true but the SLURM test cannot run: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    reason = why_unavailable()
    if reason:
        unavailable(reason)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except RuntimeError as exc:
        cluster.stop()
        unavailable(f"the SLURM daemons cannot run here: {str(exc)[:500]}")
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


def mlp_config(path: Path, max_steps: int, checkpoint_every: int = 50) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "model": {"name": "mlp", "args": {"hidden": 64}},
                "data": {"source": "digits", "batch_size": 16, "limit_train": 256},
                "optim": {"lr": 0.003, "warmup_steps": 5},
                "train": {
                    "max_steps": max_steps,
                    "eval_every": 0,
                    "checkpoint_every": checkpoint_every,
                    "log_every": 1,
                    "device": "cpu",
                },
            }
        )
    )
    return path


def launch(
    cluster: SlurmCluster, config: Path, run_dir: Path, *args: str, **env_extra: str
) -> dict[str, Any]:
    launched = subprocess.run(
        [
            sys.executable, "-m", "hpcml", "launch", "slurm", str(config),
            "--run-dir", str(run_dir), "--submit", "--json", *args,
        ],
        env={**env(cluster), **env_extra},
        capture_output=True,
        text=True,
        timeout=240,  # a loaded 2-core runner imports torch slowly; only a hang reaches this
    )  # fmt: skip
    assert launched.returncode == 0, launched.stderr
    out: dict[str, Any] = json.loads(launched.stdout)
    assert out["job_id"]
    return out


def attempt_log(run_dir: Path, job_id: str, restart: int) -> str:
    return (run_dir / "logs" / f"{job_id}-r{restart}.out").read_text()


def finished(cluster: SlurmCluster, job_id: str, timeout: float = 150) -> dict[str, str]:
    ended = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")
    return wait(  # type: ignore[no-any-return]
        f"job {job_id} to end",
        lambda: (s := cluster.job_state(job_id)).get("JobState") in ended and s,
        cluster,
        timeout=timeout,
    )


def fault_events(run_dir: Path) -> list[dict[str, Any]]:
    return [
        json.loads(line) for line in (run_dir / "run.jsonl").read_text().splitlines()
        if '"kind": "fault"' in line
    ]  # fmt: skip


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
    config = mlp_config(tmp_path / "mlp.yaml", max_steps=200)
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
    # 50 ms of sleep per step (no effect on the numbers) keeps the job running for at least 7 s
    # after step 60, so that even a starved test process sees it running to preempt it.
    slow = json.dumps({"slow": {"seconds": 0.05}})
    job_id = launch(
        slurm, config, run_dir, "--nodes", "1", "--time", "00:10:00", HPCML_FAULT_INJECT=slow
    )["job_id"]

    # Preempt once training is well under way (past its first checkpoint at step 50).
    wait(
        "60 steps",
        lambda: (run_dir / "run.jsonl").exists() and len(step_losses(run_dir)) >= 60,
        slurm,
    )
    slurm.run("scancel", "--signal=USR1", job_id)

    # The job saves, stops with the requeue code and requeues itself. SLURM holds a requeued
    # job for two minutes (its BeginTime), so that the first attempt is gone and its revoked
    # credential (revocation is kept with one-second resolution) cannot refuse the second.
    # To keep the test short: wait until the first attempt's batch step is gone, let those
    # seconds pass, and release the job.
    wait(
        "the requeue",
        lambda: (
            (s := slurm.job_state(job_id)).get("Restarts", "0") != "0"
            and s.get("JobState") == "PENDING"
            and not slurm.batch_step_alive(job_id)
        ),
        slurm,
    )
    time.sleep(2.5)
    slurm.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
    state = finished(slurm, job_id)
    log = (run_dir / f"slurm-{job_id}.out").read_text()
    assert state["JobState"] == "COMPLETED", log
    assert state["Restarts"] == "1"

    # The job log has one line per attempt and its outcome; each attempt has its own log.
    assert "attempt 1 on" in log and "attempt 2 on" in log, log
    assert f"attempt 1 saved a checkpoint and stopped: requeueing job {job_id}" in log
    assert "attempt 2 ended with exit code 0" in log
    first, second = attempt_log(run_dir, job_id, 0), attempt_log(run_dir, job_id, 1)
    assert "preempted by SIGUSR1" in first
    # A clean preemption leaves no traceback (torchrun's agent used to print one).
    assert "Traceback" not in first and "SignalException" not in first, first
    assert "resumed from" in second and "preempted by" not in second
    (preempted,) = [e for e in fault_events(run_dir) if e["event"] == "preempted"]
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


def test_the_scheduler_sees_the_cores_memory_gpus_and_requeue_the_script_asks_for(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    config = mlp_config(tmp_path / "mlp.yaml", max_steps=10)
    # Defaults from sinfo: a GPU job gets the node's cores and memory per GPU times its GPUs.
    gpu = launch(
        slurm, config, tmp_path / "gpu", "--nodes", "1", "--gpus-per-node", "2",
        "--time", "00:10:00", "--max-requeues", "2", "--sbatch=--hold",
    )  # fmt: skip
    # Given: a CPU job with 2 workers, its cores and memory per node.
    cpu = launch(
        slurm, config, tmp_path / "cpu", "--nodes", "1", "--nproc-per-node", "2",
        "--cpus-per-task", "2", "--mem", "300M", "--time", "00:10:00", "--sbatch=--hold",
    )  # fmt: skip
    try:
        g = slurm.job_state(gpu["job_id"])
        per_gpu_cores = slurm.cpus // slurm.gpus
        assert g["NumCPUs"] == str(per_gpu_cores * 2) and g["CPUs/Task"] == str(per_gpu_cores * 2)
        assert g["TresPerNode"] == "gres:gpu:2"
        assert g["MemPerTres"] == f"gres:gpu:{slurm.mem_mb // slurm.gpus}"
        assert g["NumTasks"] == "1" and g["Requeue"] == "1"
        assert gpu["max_requeues"] == 2
        c = slurm.job_state(cpu["job_id"])
        assert c["NumCPUs"] == "2" and c["CPUs/Task"] == "2"
        assert c["MinMemoryNode"] == "300M" and c["Requeue"] == "1"
        script = (tmp_path / "gpu" / "job.sbatch").read_text()
        assert "--numa-binding=node" in script and "--nproc-per-node=2" in script
    finally:
        slurm.run("scancel", gpu["job_id"], cpu["job_id"], check=False)


def test_a_gpu_job_runs_where_the_node_has_no_numactl(slurm: SlurmCluster, tmp_path: Path) -> None:
    # A GPU job's default --numa-binding needs numactl on the node; torchrun fails without it
    # (the script used to pass it unconditionally and had never run). The script asks the node.
    if shutil.which("numactl") is not None:
        pytest.skip("numactl is installed here: the fall-back is not exercised")
    config = mlp_config(tmp_path / "mlp.yaml", max_steps=4, checkpoint_every=2)
    run_dir = tmp_path / "gpu"
    job_id = launch(
        slurm, config, run_dir, "--nodes", "1", "--gpus-per-node", "1", "--time", "00:10:00",
    )["job_id"]  # fmt: skip
    state = finished(slurm, job_id, timeout=240)
    log = attempt_log(run_dir, job_id, 0)
    assert state["JobState"] == "COMPLETED", log
    job_log = (run_dir / f"slurm-{job_id}.out").read_text()
    assert "numactl is not installed on" in job_log and "without --numa-binding=node" in job_log
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 4


def test_the_real_time_limit_signals_saves_and_max_requeues_stops_the_job(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    # --time 2 min, USR1 30 s before it (slurmctld checks time limits every ~30 s, so it comes
    # 60 to 90 s in, after the workers started): the run would need far longer, so only the
    # warning can stop it. --max-requeues 0: the job saves and ends with the requeue code
    # instead of being requeued.
    config = mlp_config(tmp_path / "mlp.yaml", max_steps=1_000_000, checkpoint_every=100_000)
    run_dir = tmp_path / "run"
    job_id = launch(
        slurm, config, run_dir, "--nodes", "1", "--time", "00:02:00", "--signal-lead", "30",
        "--max-requeues", "0",
    )["job_id"]  # fmt: skip
    state = finished(slurm, job_id, timeout=240)
    log = (run_dir / f"slurm-{job_id}.out").read_text()
    assert state["JobState"] == "FAILED" and state["ExitCode"] == f"{REQUEUE_EXIT_CODE}:0", log
    assert state["Restarts"] == "0"
    assert "(--max-requeues 0): not requeueing" in log
    (preempted,) = [e for e in fault_events(run_dir) if e["event"] == "preempted"]
    assert preempted["signal"] == "SIGUSR1"
    saved = Path(preempted["checkpoint"])
    assert ckpt.verify(saved) is None and ckpt.step_of(saved) == preempted["step"]
    assert "Traceback" not in attempt_log(run_dir, job_id, 0)


def test_scancel_sends_sigterm_and_the_run_saves_within_the_grace_time(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    # Plain scancel: SIGTERM to every process of the job, SIGKILL KillWait (30 s) later.
    config = mlp_config(tmp_path / "mlp.yaml", max_steps=1_000_000, checkpoint_every=100_000)
    run_dir = tmp_path / "run"
    job_id = launch(slurm, config, run_dir, "--nodes", "1", "--time", "00:10:00")["job_id"]
    wait(
        "20 steps",
        lambda: (run_dir / "run.jsonl").exists() and len(step_losses(run_dir)) >= 20,
        slurm,
    )
    slurm.run("scancel", job_id)
    state = finished(slurm, job_id)
    assert state["JobState"] == "CANCELLED" and state["Restarts"] == "0"
    log = (run_dir / f"slurm-{job_id}.out").read_text()
    assert (
        "stopped on SIGTERM (scancel, time limit or a preemption by SLURM): not requeueing" in log
    )
    (preempted,) = [e for e in fault_events(run_dir) if e["event"] == "preempted"]
    assert preempted["signal"] == "SIGTERM"
    saved = Path(preempted["checkpoint"])
    assert ckpt.verify(saved) is None and preempted["step"] >= 20
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "preempted"


def test_a_failed_node_is_excluded_when_the_job_is_requeued(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    # The node is drained (the admin's or the health check's verdict) while the job runs, and
    # a worker dies: the attempt fails, and the job goes back to the queue without that node.
    config = mlp_config(tmp_path / "mlp.yaml", max_steps=1_000_000, checkpoint_every=100_000)
    run_dir = tmp_path / "run"
    job_id = launch(
        slurm, config, run_dir, "--nodes", "1", "--time", "00:10:00", "--max-restarts", "0"
    )["job_id"]
    pid_file = run_dir / "pids" / "rank-0.pid"
    wait("training", lambda: pid_file.exists() and len(step_losses(run_dir)) >= 5, slurm)
    slurm.run("scontrol", "update", f"NodeName={slurm.node}", "State=DRAIN", "Reason=test")
    try:
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
        state = wait(
            "the requeue without the node",
            lambda: (
                (s := slurm.job_state(job_id)).get("ExcNodeList") == slurm.node
                and s.get("JobState") == "PENDING"
                and s
            ),
            slurm,
        )
        assert state["Restarts"] == "1"
        log = (run_dir / f"slurm-{job_id}.out").read_text()
        assert f"on unhealthy node(s) {slurm.node}: requeueing job {job_id} without them" in log
    finally:
        slurm.run("scancel", job_id, check=False)
        slurm.run("scontrol", "update", f"NodeName={slurm.node}", "State=RESUME", check=False)


def test_tune_workers_as_a_job_array_share_one_study(slurm: SlurmCluster, tmp_path: Path) -> None:
    """`hpcml launch slurm --tune-workers 2`: a job array of two `hpcml tune` workers (one core
    each, so both run at once on the 2-core node) on the journal file in the study folder;
    together they run exactly the study's 2 trials, and each worker ends with the whole
    study's summary."""
    from tests.integration.test_tune import load, tune_config

    config = tune_config(tmp_path / "tune.yaml", {"pruner": "none", "trials": 2}, max_steps=10)
    out = tmp_path / "study"
    job_id = launch(
        slurm, config, out, "--nodes", "1", "--time", "00:10:00", "--cpus-per-task", "1",
        "--mem", "300M", "--tune-workers", "2",
    )["job_id"]  # fmt: skip
    for task in (0, 1):
        state = finished(slurm, f"{job_id}_{task}", timeout=300)
        assert state["JobState"] == "COMPLETED", (state, slurm.logs())
    for task in (0, 1):  # each array task's own log ends with its tune's --json line
        log = (out / f"slurm-{job_id}_{task}.out").read_text()
        result = json.loads(log.strip().splitlines()[-1])
        assert result["trials"] == {"complete": 2, "pruned": 0, "failed": 0, "infeasible": 0}
        assert result["storage"] == f"journal:{out.resolve() / 'study.journal'}"
    trials = load(out).get_trials()
    assert len(trials) == 2  # the two workers never overshot the budget
    assert all(Path(t.user_attrs["run_dir"]).parent == out / "trials" for t in trials)
