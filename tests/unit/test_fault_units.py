"""The pieces of hpcml.train.fault and hpcml.launch.slurm that need no training run."""

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

from hpcml.config import RunConfig, load_config
from hpcml.distributed.runtime import Runtime
from hpcml.distributed.sidechannel import HeartBoard
from hpcml.errors import REQUEUE_EXIT_CODE, ConfigError, HpcmlError, LaunchError, Preempted
from hpcml.launch.slurm import SlurmJob, parse_time_s, render_sbatch
from hpcml.train.fault import (
    FaultInjector,
    PreemptionFlag,
    SpikeDetector,
    Watchdog,
    checkpoint_advice,
)

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


def test_injector_rejects_unknown_faults_and_filters_by_rank(monkeypatch: pytest.MonkeyPatch) -> None:
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
    assert "--nproc-per-node=8" in text and "--nnodes=\"$SLURM_JOB_NUM_NODES\"" in text
    assert "optim.lr=0.01" in text and "--resume auto" in text
    assert "SIGUSR1" in text and 'scontrol requeue "$SLURM_JOB_ID"' in text
    assert f"'{tmp_path / 'run dir'}'" in text
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


def test_slurm_job_rejects_a_signal_lead_longer_than_the_time_limit(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="does not fit"):
        SlurmJob(config=Path("c.yaml"), run_dir=tmp_path, nodes=1, time="00:01:00")
    with pytest.raises(LaunchError, match="--nodes 0"):
        SlurmJob(config=Path("c.yaml"), run_dir=tmp_path, nodes=0, time="01:00:00")


def test_cli_checkpoint_interval_json_and_bad_input() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, "-m", "hpcml", "launch", "checkpoint-interval"]
    ok = subprocess.run(
        [*cmd, "--checkpoint-s", "60", "--node-mtbf", "1000d", "--nodes", "500",
         "--step-time-s", "1.5", "--json"],
        env=env, capture_output=True, text=True, timeout=60,
    )
    assert ok.returncode == 0, ok.stderr
    advice = json.loads(ok.stdout)
    assert advice["mtbf_s"] == pytest.approx(1000 * 86_400 / 500)
    assert advice["young_interval_s"] == pytest.approx(math.sqrt(2 * 60 * advice["mtbf_s"]))
    bad = subprocess.run(
        [*cmd, "--checkpoint-s", "60", "--mtbf", "soon"],
        env=env, capture_output=True, text=True, timeout=60,
    )
    assert bad.returncode == 2
    assert "--mtbf 'soon' is not a positive duration" in bad.stderr
    assert "Traceback" not in bad.stderr
