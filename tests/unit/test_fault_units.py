"""The pieces of hpcml.train.fault.guard and hpcml.launch.slurm that need no training run."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tests.conftest import hpcml_proc

from hpcml.config import RunConfig, load_config
from hpcml.distributed.runtime import Runtime
from hpcml.distributed.sidechannel import HeartBoard
from hpcml.errors import REQUEUE_EXIT_CODE, ConfigError, HpcmlError, LaunchError, Preempted
from hpcml.launch.slurm import NodeShape, SlurmJob, parse_sinfo, parse_time_s, render_sbatch
from hpcml.train.checkpoint.phase import Phase
from hpcml.train.fault.guard import (
    FaultInjector,
    PreemptionFlag,
    SpikeDetector,
    Watchdog,
    checkpoint_advice,
)
from hpcml.train.fault.stop_signals import agreed

ROOT = Path(__file__).resolve().parents[2]


def runtime(world: int = 1, rank: int = 0) -> Runtime:
    return Runtime(rank, rank, world, world, torch.device("cpu"), None)


# --- preemption ----------------------------------------------------------------------------


def test_preemption_signal_only_sets_a_flag_and_handlers_are_restored() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    flag = PreemptionFlag(["SIGTERM", "SIGUSR1"])
    assert flag.install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)  # default action would end this process
        deadline = time.monotonic() + 5
        while not flag.requested and time.monotonic() < deadline:
            time.sleep(0.01)
        assert flag.requested and flag.received == signal.SIGUSR1
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal does not overwrite the first
        time.sleep(0.05)
        assert flag.received == signal.SIGUSR1
    finally:
        flag.restore()
    assert signal.getsignal(signal.SIGUSR1) == before


def wait_until(predicate: object, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:  # type: ignore[operator]
        time.sleep(0.01)


def test_sigint_is_an_interrupt_never_a_preemption_and_escalates_only_on_one_process() -> None:
    # SIGINT only sets the interrupt flag (no KeyboardInterrupt mid-collective or mid-write)
    # and never counts as a preemption, which would save a checkpoint. Several ranks: a second
    # one changes nothing (the torchrun agent acts on it).
    before = signal.getsignal(signal.SIGINT)
    flag = PreemptionFlag(["SIGTERM"], interrupt=True)
    assert flag.install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        wait_until(lambda: flag.interrupted)
        assert flag.interrupted and not flag.requested
        assert flag.flags() == [0.0, 1.0]
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)
        wait_until(lambda: flag.requested)
        assert flag.flags() == [1.0, 1.0] and flag.received == signal.SIGTERM
    finally:
        flag.restore()
    assert signal.getsignal(signal.SIGINT) == before
    # One process: the second Ctrl-C raises KeyboardInterrupt at once.
    single = PreemptionFlag(["SIGTERM"], interrupt=True, escalate=True)
    assert single.install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        wait_until(lambda: single.interrupted)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    finally:
        single.restore()
    assert signal.getsignal(signal.SIGINT) == before


def test_a_ctrl_c_wrapped_by_torch_checkpoint_is_recognised() -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    from hpcml.train.checkpoint.store import interrupted_inside

    assert interrupted_inside(CheckpointException("x", {0: (KeyboardInterrupt(), None)}))
    assert not interrupted_inside(CheckpointException("x", {0: (OSError("disk"), None)}))
    assert not interrupted_inside(KeyboardInterrupt())


def test_agreed_stop_preemption_wins_over_ctrl_c_on_another_rank() -> None:
    # Flags summed over 2 ranks: [preemption, interrupt].
    assert agreed([0.0, 0.0]) == (False, False)
    assert agreed([0.0, 1.0]) == (False, True)
    assert agreed([0.0, 0.5]) == (False, True)  # the metrics flush averages the flags
    assert agreed([1.0, 1.0]) == (True, False)  # the scheduler asked for a checkpoint
    assert agreed([2.0, 0.0]) == (True, False)
    assert agreed([1.0]) == (True, False)


def test_requeue_exit_code_is_ex_tempfail_and_distinct() -> None:
    assert REQUEUE_EXIT_CODE == 75 == Preempted("x").exit_code
    assert REQUEUE_EXIT_CODE not in (0, 1, 2, 128 + signal.SIGTERM, 128 + signal.SIGUSR1)


# --- spikes --------------------------------------------------------------------------------


def test_spike_detector_needs_a_full_window_and_flags_only_upward_outliers() -> None:
    d = SpikeDetector(zscore=6.0, window=10)
    for i in range(9):
        d.add(1.0 + 0.01 * (i % 3))
    assert d.score(100.0) is None  # window not full yet: no verdict
    d.add(1.01)
    assert d.is_spike(100.0)
    assert not d.is_spike(1.02)
    assert not d.is_spike(0.0)  # a sudden drop is not a spike
    assert SpikeDetector(None, 10).score(5.0) is None  # off


def test_spike_detector_with_a_flat_window_gives_no_score() -> None:
    d = SpikeDetector(zscore=3.0, window=5)
    for _ in range(5):
        d.add(2.0)
    assert d.score(3.0) is None


# --- fault injection -----------------------------------------------------------------------


def test_injector_rejects_unknown_faults_and_filters_by_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HPCML_FAULT_INJECT", json.dumps({"meteor": {"step": 1}}))
    with pytest.raises(ConfigError, match="meteor"):
        FaultInjector.from_env(0)
    monkeypatch.setenv("HPCML_FAULT_INJECT", "{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        FaultInjector.from_env(0)
    monkeypatch.setenv("HPCML_FAULT_INJECT", json.dumps({"nan": {"step": 3, "rank": 1}}))
    assert FaultInjector.from_env(0).spec == {}  # type: ignore[union-attr]
    inj = FaultInjector.from_env(1)
    assert inj is not None
    out = torch.ones(2)
    assert torch.equal(inj.after_forward(out, 2), out)
    assert torch.isnan(inj.after_forward(out, 3)).all()
    assert torch.equal(inj.after_forward(out, 3), out)  # once: a replayed step is clean


# --- watchdog diagnosis --------------------------------------------------------------------


def test_watchdog_names_the_rank_that_made_the_least_progress() -> None:
    board = HeartBoard(runtime(world=3))
    board._local = {
        0: {"step": 6, "progress": 42, "idle_s": 9.0},
        1: {"step": 6, "progress": 41, "idle_s": 9.5},
        2: {"step": 6, "progress": 42, "idle_s": 9.0},
    }
    dog = Watchdog(8.0, runtime(world=3), board, on_fire=lambda m: None)
    message = dog.diagnose(9.0)
    assert message.startswith("rank 1 stopped answering at step 6")
    assert "fault.watchdog_s=8" in message


def test_watchdog_says_so_when_no_single_rank_is_behind() -> None:
    board = HeartBoard(runtime(world=2))
    board._local = {r: {"step": 4, "progress": 10, "idle_s": 5.0} for r in range(2)}
    message = Watchdog(3.0, runtime(world=2), board, on_fire=lambda m: None).diagnose(5.0)
    assert message.startswith("ranks 0, 1 all stopped making progress at step 4")


def test_watchdog_fires_once_without_progress_and_not_while_paused() -> None:
    fired: list[str] = []
    dog = Watchdog(0.3, runtime(), HeartBoard(runtime()), fired.append, poll_s=0.02)
    dog.start()
    try:
        dog.tick(1)
        with dog.paused():
            time.sleep(0.6)
        assert fired == []  # a checkpoint write is not a hang
        time.sleep(0.8)
        assert len(fired) == 1 and "rank 0 stopped answering at step 1" in fired[0]
    finally:
        dog.stop()


def test_watchdog_ends_a_checkpoint_phase_that_outlives_its_timeout() -> None:
    dog = Watchdog(0, runtime(), HeartBoard(runtime()), lambda m: None, checkpoint_timeout_s=5)
    fsync = Phase("fsync", step=40, started=100.0)
    assert dog.check(104.0, fsync) is None
    message = dog.check(106.0, fsync)
    assert message is not None
    assert message.startswith("rank 0 stalled in the fsync phase of the checkpoint of step 40")
    assert "fault.checkpoint_timeout_s=5" in message
    assert dog.check(106.0, None) is None  # no save under way: nothing to time


def test_a_rank_waiting_at_the_barrier_names_the_rank_whose_phase_stalled() -> None:
    rt = runtime(world=3, rank=2)
    board = HeartBoard(rt)
    board._local = {
        0: {"step": 9, "progress": 5, "phase": "manifest", "phase_s": 30.0},
        1: {"step": 9, "progress": 5, "phase": "wait", "phase_s": 31.0},
        2: {"step": 9, "progress": 5, "phase": "wait", "phase_s": 31.0},
    }
    dog = Watchdog(0, rt, board, lambda m: None, checkpoint_timeout_s=10)
    message = dog.check(200.0, Phase("wait", step=9, started=169.0))
    assert message is not None
    assert message.startswith("rank 0 stalled in the manifest phase of the checkpoint of step 9")


def test_preemption_grace_counts_only_for_a_save_already_under_way() -> None:
    flag = PreemptionFlag(["SIGTERM"])
    flag.received_at = 50.0
    dog = Watchdog(
        0,
        runtime(),
        HeartBoard(runtime()),
        lambda m: None,
        checkpoint_timeout_s=3600,
        preemption=flag,
        preempt_grace_s=20,
    )
    stalled = Phase("rename", step=7, started=10.0)  # before the signal
    assert dog.check(69.0, stalled) is None
    message = dog.check(71.0, stalled)
    assert message is not None and "when a preemption signal came 21 s ago" in message
    # The save the signal asked for (started after it) gets the checkpoint timeout instead.
    assert dog.check(500.0, Phase("write", step=8, started=55.0)) is None
    # A background save whose write began before the signal but whose fsync began after it
    # (it waited for the other ranks' hashes) was under way: the grace counts for it.
    late_fsync = Phase("fsync", step=5, started=52.0, save_started=40.0)
    message = dog.check(71.0, late_fsync)
    assert message is not None and "the fsync phase of the checkpoint of step 5" in message


# --- checkpoint interval -------------------------------------------------------------------


def test_checkpoint_advice_uses_young_and_daly() -> None:
    a = checkpoint_advice(checkpoint_s=60, mtbf_s=86_400)
    # Young: sqrt(2 * 60 s * 24 h) = 3220 s; Daly's higher-order estimate is a little below.
    assert a["young_interval_s"] == pytest.approx(math.sqrt(2 * 60 * 86_400))
    assert 3150 < a["daly_interval_s"] < a["young_interval_s"]
    assert checkpoint_advice(500, 200)["daly_interval_s"] == 200  # C >= 2M: once per MTBF
    with pytest.raises(HpcmlError):
        checkpoint_advice(0, 10)


def test_checkpoint_advice_converts_to_steps_and_prices_failures() -> None:
    a = checkpoint_advice(checkpoint_s=60, mtbf_s=86_400, restart_s=120, step_time_s=2.0)
    assert a["checkpoint_every_steps"] == round(a["daly_interval_s"] / 2.0)
    assert a["expected_lost_work_per_failure_s"] == pytest.approx(a["daly_interval_s"] / 2 + 120)
    # sqrt(2 C / M) = 3.7% for C = 60 s, M = 1 day, plus restarts: well inside (0, 10%).
    assert 0 < a["expected_overhead_fraction"] < 0.1
    assert a["expected_goodput"] == pytest.approx(1 - a["expected_overhead_fraction"])


# --- config --------------------------------------------------------------------------------


def test_fault_section_defaults_and_errors(tmp_path: Path) -> None:
    cfg = RunConfig()
    assert cfg.fault.nan_policy == "skip" and cfg.fault.spike_zscore is None
    assert cfg.fault.preempt_signals == ["SIGTERM", "SIGUSR1"]
    assert cfg.train.checkpoint_async is False
    with pytest.raises(ConfigError, match="fault.nan_policy"):
        load_config(None, ["fault.nan_policy=ignore"])
    with pytest.raises(ConfigError, match="fault.watchdog"):
        load_config(None, ["fault.watchdog=3"])


# --- SLURM script --------------------------------------------------------------------------


def test_parse_time() -> None:
    assert parse_time_s("04:00:00") == 4 * 3600
    assert parse_time_s("1-02:03:04") == 86_400 + 2 * 3600 + 3 * 60 + 4
    assert parse_time_s("30:00") == 1800
    for bad in ("4h", "00:61:00", "", "1:2:3:4"):
        with pytest.raises(LaunchError, match="--time"):
            parse_time_s(bad)


def test_sbatch_script_has_what_preemption_needs_and_is_valid_bash(tmp_path: Path) -> None:
    job = SlurmJob(
        config=ROOT / "examples" / "digits_cnn.yaml",
        run_dir=tmp_path / "run dir",  # a space: every path must be quoted
        nodes=4,
        time="12:00:00",
        gpus_per_node=8,
        partition="gpu",
        account="ml",
        cpus_per_task=64,
        overrides=["optim.lr=0.01"],
        sbatch_extra=["--exclusive"],
    )
    text = render_sbatch(job)
    for line in (
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --cpus-per-task=64",
        "#SBATCH --time=12:00:00",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=ml",
        "#SBATCH --signal=USR1@90",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        "#SBATCH --exclusive",
    ):
        assert line in text.splitlines()
    assert "--rdzv-backend=c10d" in text and '--rdzv-endpoint="$head_node:$rdzv_port"' in text
    assert "--nproc-per-node=8" in text and '--nnodes="$SLURM_JOB_NUM_NODES"' in text
    assert "optim.lr=0.01" in text and "--resume auto" in text
    assert "SIGUSR1" in text and 'scontrol requeue "$SLURM_JOB_ID"' in text
    # One torchrun per node, through hpcml's agent, bound next to its GPUs, with every core.
    assert 'srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 --cpus-per-task=64' in text
    assert "-m hpcml.launch.agent" in text and "--numa-binding=node" in text
    assert 'if [ "$restarts" -ge 3 ]' in text  # --max-requeues default 3
    assert "OMP_NUM_THREADS:-8" in text  # 64 cores / 8 workers
    assert f"'{tmp_path / 'run dir'}'" in text
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


def test_sinfo_node_shape_is_the_smallest_node_with_enough_gpus() -> None:
    text = "\n".join(
        [
            "64|512000|gpu:a100:8(S:0-1)",
            "96|1024000|gpu:8,mps:100",
            "32|256000|gpu:4",  # too few GPUs for 8 per node: left out
            "16|64000|(null)",
        ]
    )
    assert parse_sinfo(text, gpus_wanted=8) == NodeShape(cpus=64, mem_mb=512000, gpus=8)
    assert parse_sinfo(text, gpus_wanted=0) == NodeShape(cpus=16, mem_mb=64000, gpus=0)
    assert parse_sinfo("garbage\n", 0) is None


def test_default_cores_and_memory_come_from_the_node_per_gpu(tmp_path: Path) -> None:
    node = NodeShape(cpus=96, mem_mb=1_000_000, gpus=8)
    job = SlurmJob(
        config=Path("c.yaml"), run_dir=tmp_path, nodes=2, time="01:00:00", gpus_per_node=4
    )
    job.fill_from(node)
    assert job.cpus_per_task == 48 and job.mem_per_gpu == "125000M" and job.mem is None
    lines = render_sbatch(job).splitlines()
    assert "#SBATCH --cpus-per-task=48" in lines and "#SBATCH --mem-per-gpu=125000M" in lines
    cpu = SlurmJob(config=Path("c.yaml"), run_dir=tmp_path, nodes=1, time="01:00:00")
    cpu.fill_from(NodeShape(cpus=32, mem_mb=128_000, gpus=0))
    assert cpu.cpus_per_task == 32 and cpu.mem == "128000M"
    given = SlurmJob(
        config=Path("c.yaml"), run_dir=tmp_path, nodes=1, time="01:00:00", cpus_per_task=4, mem="8G"
    )
    given.fill_from(None)  # nothing to ask: sinfo is not needed
    with pytest.raises(LaunchError, match="--cpus-per-task and --mem"):
        SlurmJob(config=Path("c.yaml"), run_dir=tmp_path, nodes=1, time="01:00:00").fill_from(None)


def test_slurm_job_rejects_resources_that_cannot_work(tmp_path: Path) -> None:
    base = {"config": Path("c.yaml"), "run_dir": tmp_path, "nodes": 1, "time": "01:00:00"}
    with pytest.raises(LaunchError, match="fewer than the 8 workers"):
        SlurmJob(**base, gpus_per_node=8, cpus_per_task=4)  # type: ignore[arg-type]
    with pytest.raises(LaunchError, match="--mem '1.5TB' is not a SLURM memory size"):
        SlurmJob(**base, mem="1.5TB")  # type: ignore[arg-type]
    with pytest.raises(LaunchError, match="not both"):
        SlurmJob(**base, gpus_per_node=1, mem="1G", mem_per_gpu="1G")  # type: ignore[arg-type]
    with pytest.raises(LaunchError, match="--mem-per-gpu needs --gpus-per-node"):
        SlurmJob(**base, mem_per_gpu="1G")  # type: ignore[arg-type]
    with pytest.raises(LaunchError, match="--max-requeues -1"):
        SlurmJob(**base, max_requeues=-1)  # type: ignore[arg-type]


def test_slurm_job_rejects_a_signal_lead_longer_than_the_time_limit(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="does not fit"):
        SlurmJob(config=Path("c.yaml"), run_dir=tmp_path, nodes=1, time="00:01:00")
    # SLURM may warn up to a minute early: 90 s must remain for training to have started.
    SlurmJob(config=Path("c.yaml"), run_dir=tmp_path, nodes=1, time="00:02:00", signal_lead_s=30)
    with pytest.raises(LaunchError, match="up to 60 s early"):
        SlurmJob(
            config=Path("c.yaml"), run_dir=tmp_path, nodes=1, time="00:02:00", signal_lead_s=31
        )
    with pytest.raises(LaunchError, match="--nodes 0"):
        SlurmJob(config=Path("c.yaml"), run_dir=tmp_path, nodes=0, time="01:00:00")


def test_cli_checkpoint_interval_json_and_bad_input() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, "-m", "hpcml", "launch", "checkpoint-interval"]
    ok = subprocess.run(
        [
            *cmd,
            "--checkpoint-s",
            "60",
            "--node-mtbf",
            "1000d",
            "--nodes",
            "500",
            "--step-time-s",
            "1.5",
            "--json",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ok.returncode == 0, ok.stderr
    advice = json.loads(ok.stdout)
    assert advice["mtbf_s"] == pytest.approx(1000 * 86_400 / 500)
    assert advice["young_interval_s"] == pytest.approx(math.sqrt(2 * 60 * advice["mtbf_s"]))
    bad = subprocess.run(
        [*cmd, "--checkpoint-s", "60", "--mtbf", "soon"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2
    assert "--mtbf 'soon' is not a positive duration" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_restarts_without_checkpoints_are_refused_and_mtbf_gives_a_daly_interval(
    tmp_path: Path,
) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    config = tmp_path / "c.yaml"
    config.write_text("model: {name: mlp}\ndata: {source: digits}\ntrain: {checkpoint_every: 0}\n")

    def hpcml(*args: str) -> subprocess.CompletedProcess[str]:
        return hpcml_proc(list(args), env=env, timeout=120)  # forked (tests/conftest.py)

    train = hpcml("train", str(config), "--nproc", "2", "--max-restarts", "1",
                  "--run-dir", str(tmp_path / "t"))  # fmt: skip
    assert train.returncode == 2 and "a restart would start again from step 0" in train.stderr
    assert "Traceback" not in train.stderr and not (tmp_path / "t").exists()

    base = ["launch", "slurm", str(config), "--nodes", "1", "--time", "04:00:00",
            "--cpus-per-task", "4", "--mem", "8G", "--run-dir", str(tmp_path / "s"), "--json"]  # fmt: skip
    refused = hpcml(*base)
    assert refused.returncode == 2 and "pass --mtbf" in refused.stderr
    assert not (tmp_path / "s" / "job.sbatch").exists()
    planned = hpcml(*base, "--mtbf", "24h", "--checkpoint-s", "60")
    assert planned.returncode == 0, planned.stderr
    every_s = json.loads(planned.stdout)["checkpoint_every_s"]
    # Daly's interval for C = 60 s, M = 24 h lies just below Young's sqrt(2CM) = 3220 s.
    assert 3150 < every_s < math.sqrt(2 * 60 * 86_400)
    script = (tmp_path / "s" / "job.sbatch").read_text()
    assert f"train.checkpoint_every_s={every_s:.0f}" in script


def test_checkpoint_timeout_follows_the_bytes_and_the_measured_write_bandwidth() -> None:
    # Issue 29: the timeout of a checkpoint phase was a constant 1800 s whatever the size: a
    # hung write of a few MB waited half an hour, a slow write of a large shard was killed.
    from hpcml.train.checkpoint import store as ckpt
    from hpcml.train.fault.guard import FaultGuard

    spec = {"model": {"name": "mlp"}, "data": {"source": "digits"}}
    guard = FaultGuard(RunConfig.model_validate(spec), runtime())
    before = len(ckpt.timings)
    try:
        guard.watch_checkpoints()
        dog = guard.watchdog
        assert dog is not None
        with guard.checkpointing(500_000_000):  # no save measured yet: 100 MB/s assumed
            assert dog.checkpoint_timeout_s == pytest.approx(120 + 20 * 5.0)
            assert "at 100 MB/s assumed" in dog.checkpoint_timeout_why
        ckpt.timings.append(ckpt.SaveTiming(step=1, background=False, stall_s=1.0))
        with guard.checkpointing(1_000_000_000):  # that save wrote 500 MB/s
            assert dog.checkpoint_timeout_s == pytest.approx(120 + 20 * 2.0)
            assert "at 500 MB/s measured" in dog.checkpoint_timeout_why
        # A background save on rank 0 knows when it was durable: that time, not the stall.
        ckpt.timings.append(ckpt.SaveTiming(step=2, background=True, stall_s=0.1, total_s=4.0))
        with guard.checkpointing(3_000_000_000, saving=False):  # a read, at 250 MB/s
            assert dog.checkpoint_timeout_s == pytest.approx(120 + 20 * 12.0)
    finally:
        del ckpt.timings[before:]
        guard.close()
    given = RunConfig.model_validate({**spec, "fault": {"checkpoint_timeout_s": 7}})
    guard = FaultGuard(given, runtime())
    try:
        guard.watch_checkpoints()
        with guard.checkpointing(10**12):
            assert guard.watchdog is not None and guard.watchdog.checkpoint_timeout_s == 7
    finally:
        guard.close()
