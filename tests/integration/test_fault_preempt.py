"""Preemption: a real signal to a real training process makes it save at the next step boundary
and exit with the requeue code; `--resume auto` then continues bit for bit (CPU, fp32)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from fault_util import (
    finish,
    pid_of,
    records,
    run_train,
    start_train,
    step_losses,
    summary,
    wait_for,
    write_config,
)

from hpcml.errors import REQUEUE_EXIT_CODE
from hpcml.train.checkpoint import store as ckpt

pytestmark = pytest.mark.slow


def test_sigterm_saves_exits_75_and_resume_matches_an_uninterrupted_run(tmp_path: Path) -> None:
    # Background (async) checkpoints in the interrupted run, synchronous ones in the reference:
    # checkpointing must not change training, and an async checkpoint must resume exactly.
    config = write_config(tmp_path / "c.yaml")
    ref = start_train(config, tmp_path / "ref")
    run = tmp_path / "run"
    proc = start_train(config, run, "train.checkpoint_async=true")
    # Past the first checkpoint (step 10) and between two others: the stop saves its own.
    wait_for("15 logged steps", lambda: len(records(run)) >= 15, proc=proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = finish(proc, 120)
    assert proc.returncode == REQUEUE_EXIT_CODE, out
    assert "preempted by SIGTERM" in out and "--resume auto" in out

    stopped = summary(run)
    assert stopped["status"] == "preempted"
    event = [r for r in records(run, "fault") if r["event"] == "preempted"]
    assert len(event) == 1 and event[0]["signal"] == "SIGTERM"
    at = event[0]["step"]
    # >= 15: sent after 15 logged steps; < 60: handled before the run's last step (max_steps).
    # Speed-bound: a CPU running 45 steps within one 50 ms poll would fail it.
    assert 15 <= at < 60
    saved = Path(event[0]["checkpoint"])
    assert saved == run / "checkpoints" / f"step-{at}" and ckpt.verify(saved) is None

    resumed = run_train(config, run, "--resume", "auto", "train.checkpoint_async=true")
    assert resumed.returncode == 0, resumed.stderr
    finish(ref, 240)
    assert ref.returncode == 0
    done = summary(run)
    assert done["status"] == "finished" and done["steps"] == 60
    assert done["resumed_from"] == str(saved)
    # The preempted run's summary kept its provenance: the same config and data as the run
    # that finished it (on main a preempted summary had none).
    for key in ("config_hash", "data_fingerprint", "packages"):
        assert stopped["provenance"][key] == done["provenance"][key]
    assert "--resume" not in stopped["provenance"]["command"]

    expected, got = step_losses(tmp_path / "ref"), step_losses(run)
    assert sorted(got) == list(range(1, 61))
    assert got == expected  # bit for bit: JSON floats round-trip exactly
    assert done["final"] == summary(tmp_path / "ref")["final"]


def test_sigusr1_to_one_worker_stops_every_rank_at_the_same_step_without_a_restart(
    tmp_path: Path,
) -> None:
    # Only rank 1 gets the signal; the step-boundary collective makes rank 0 stop with it, the
    # checkpoint holds both ranks' state, and the parent `hpcml train` exits with the code too.
    # With --max-restarts the agent must not spend a restart on it and train on.
    config = write_config(tmp_path / "c.yaml", train={"max_steps": 400})
    run = tmp_path / "run"
    proc = start_train(
        config, run, "--nproc", "2", "--max-restarts", "2", "train.checkpoint_async=true"
    )
    wait_for("rank 1 training", lambda: pid_of(run, 1) and len(records(run)) >= 12, proc=proc)
    workers = (pid_of(run, 0), pid_of(run, 1))
    os.kill(workers[1] or 0, signal.SIGUSR1)
    out, _ = finish(proc, 120)
    assert proc.returncode == REQUEUE_EXIT_CODE, out
    assert (pid_of(run, 0), pid_of(run, 1)) == workers  # no restarted group wrote new pids
    assert "Traceback" not in out and "resumed from" not in out

    event = [r for r in records(run, "fault") if r["event"] == "preempted"]
    assert len(event) == 1
    at = event[0]["step"]
    # Handled before the run's last step (max_steps 400).
    assert at < 400
    saved = run / "checkpoints" / f"step-{at}"
    assert ckpt.verify(saved) is None
    assert {p.name for p in saved.glob("rank-*.pt")} == {"rank-0.pt", "rank-1.pt"}
    # The last logged step is the one saved: nothing was trained past the checkpoint.
    assert max(step_losses(run)) == at
    assert summary(run)["status"] == "preempted"

    # Resumed on two ranks, the run continues bit for bit like an uninterrupted one (run side
    # by side; the LR horizon stays 400 steps through optim.decay_steps, so both stop early).
    short = (f"train.max_steps={at + 4}", "optim.decay_steps=400")
    resumed = start_train(config, run, "--nproc", "2", "--resume", "auto", *short)
    ref = start_train(config, tmp_path / "ref", "--nproc", "2", *short)
    for p in (resumed, ref):
        out, _ = finish(p, 240)
        assert p.returncode == 0, out
    assert summary(run)["resumed_from"] == str(saved)
    assert sorted(step_losses(run)) == list(range(1, at + 5))
    assert step_losses(run) == step_losses(tmp_path / "ref")
    assert summary(run)["final"] == summary(tmp_path / "ref")["final"]


def test_ctrl_c_of_a_two_process_run_without_checkpoints_exits_130_interrupted(
    tmp_path: Path,
) -> None:
    # Ctrl-C in a terminal: SIGINT to the whole foreground process group (hpcml train and the
    # torchrun agent; torchrun starts the workers in sessions of their own). No checkpoint was
    # saved, so this is not a preemption: 130, status "interrupted", and nothing that says a
    # checkpoint exists. The agent gets SIGINT twice per press (from the group, and forwarded by
    # hpcml train); a second one used to break off its shutdown, after which torchrun sent
    # SIGTERM and a worker saved a "preemption" checkpoint (seen in CI). Two presses 20 ms apart
    # (four deliveries) make that race near certain; the first press alone must already stop it.
    config = write_config(tmp_path / "c.yaml", train={"max_steps": 100_000, "checkpoint_every": 0})
    run = tmp_path / "run"
    proc = start_train(config, run, "--nproc", "2")
    wait_for("training", lambda: pid_of(run, 1) and len(records(run)) >= 5, proc=proc)
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = finish(proc, 120)
    assert proc.returncode == 130, out
    assert "was interrupted (SIGINT); no checkpoint was saved for it" in out, out
    assert "preempted" not in out
    assert summary(run)["status"] == "interrupted"
    assert not (run / "checkpoints").exists()
    # The workers record Ctrl-C and stop together at a step boundary (a KeyboardInterrupt
    # mid-collective left a worker deadlocked at exit: torchrun killed it 120 s later, in CI).
    event = [r for r in records(run, "fault") if r["event"] == "interrupted"]
    assert len(event) == 1, records(run, "fault")
    assert max(step_losses(run)) == event[0]["step"]


def test_sigint_to_one_worker_stops_every_rank_at_one_step_without_a_restart(
    tmp_path: Path,
) -> None:
    # Only rank 1 gets SIGINT (the agent none): the flags collective stops rank 0 at the same
    # step, no checkpoint is written, and exit 130 is not a crash, so --max-restarts does not
    # start a new group. Before, rank 1 raised KeyboardInterrupt wherever it was and rank 0
    # failed in its next collective: a "failed" run, a traceback, and an elastic restart.
    # (Restarts need periodic checkpoints; every 50,000 steps writes none in this run.)
    config = write_config(
        tmp_path / "c.yaml", train={"max_steps": 100_000, "checkpoint_every": 50_000}
    )
    run = tmp_path / "run"
    proc = start_train(config, run, "--nproc", "2", "--max-restarts", "2")
    wait_for("rank 1 training", lambda: pid_of(run, 1) and len(records(run)) >= 5, proc=proc)
    workers = (pid_of(run, 0), pid_of(run, 1))
    os.kill(workers[1] or 0, signal.SIGINT)
    out, _ = finish(proc, 120)
    assert proc.returncode == 130, out
    assert "was interrupted (SIGINT); no checkpoint was saved for it" in out, out
    assert "Traceback" not in out
    assert (pid_of(run, 0), pid_of(run, 1)) == workers  # no restarted group wrote new pids
    assert summary(run)["status"] == "interrupted"
    assert not (run / "checkpoints").exists()
    event = [r for r in records(run, "fault") if r["event"] == "interrupted"]
    assert len(event) == 1 and max(step_losses(run)) == event[0]["step"]


def test_a_second_ctrl_c_kills_workers_that_never_reach_a_step_boundary(tmp_path: Path) -> None:
    # Rank 1 hangs in step 5 (an injected sleep; the phase watchdog is off), so no rank reaches
    # the step boundary where Ctrl-C is acted on, and the agent would wait for them for its
    # shutdown timeout (120 s). A second press, more than 1 s after the first, kills them.
    config = write_config(
        tmp_path / "c.yaml",
        train={"max_steps": 100_000, "checkpoint_every": 0},
        fault={"watchdog_s": 0},
    )
    run = tmp_path / "run"
    stall = json.dumps({"stall": {"rank": 1, "step": 5, "seconds": 3600}})
    proc = start_train(config, run, "--nproc", "2", HPCML_FAULT_INJECT=stall)
    wait_for("step 4", lambda: pid_of(run, 1) and len(records(run)) >= 4, proc=proc)
    workers = (pid_of(run, 0), pid_of(run, 1))
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(2)  # the first press's flag is set; rank 1 still sleeps, rank 0 waits for it
    assert all(psutil.pid_exists(p or 0) for p in workers)
    os.killpg(proc.pid, signal.SIGINT)
    # Bounded well under the 120 s the agent would otherwise wait before its own SIGKILL.
    out, _ = finish(proc, 60)
    assert proc.returncode == 130, out
    assert "got SIGINT again: killing the workers now" in out, out
    assert "was interrupted (SIGINT); no checkpoint was saved for it" in out, out
    assert not any(psutil.pid_exists(p or 0) for p in workers)
    assert not (run / "summary.json").exists()  # nothing claims the killed run finished


def test_ctrl_c_of_one_process_stops_at_the_step_boundary_never_mid_checkpoint(
    tmp_path: Path,
) -> None:
    # A checkpoint every 2 steps: SIGINT lands in a save about half the time. It used to raise
    # KeyboardInterrupt there, which torch.distributed.checkpoint turned into a
    # CheckpointException: a traceback and exit 1 ("failed"). Now the step ends first.
    config = write_config(
        tmp_path / "c.yaml", train={"max_steps": 100_000, "checkpoint_every": 2, "keep_last": 2}
    )
    run = tmp_path / "run"
    proc = start_interruptible(config, run)
    wait_for("step 15", lambda: len(records(run)) >= 15, proc=proc)
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = finish(proc, 120)
    assert proc.returncode == 130, out
    assert "Traceback" not in out
    assert summary(run)["status"] == "interrupted"
    event = [r for r in records(run, "fault") if r["event"] == "interrupted"]
    assert len(event) == 1 and max(step_losses(run)) == event[0]["step"]
    saved = sorted((run / "checkpoints").glob("step-*"))
    assert saved and all(ckpt.verify(p) is None for p in saved)


def test_a_second_ctrl_c_stops_one_process_at_once(tmp_path: Path) -> None:
    # The step never ends (an injected 3,600 s sleep in step 5): the second press raises.
    config = write_config(tmp_path / "c.yaml", train={"max_steps": 100_000}, fault={"watchdog_s": 0})
    run = tmp_path / "run"
    stall = json.dumps({"stall": {"rank": 0, "step": 5, "seconds": 3600}})
    proc = start_interruptible(config, run, HPCML_FAULT_INJECT=stall)
    wait_for("step 4", lambda: len(records(run)) >= 4, proc=proc)
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(1)
    assert proc.poll() is None  # the first press waits for the step boundary
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = finish(proc, 60)
    assert proc.returncode == 130, out
    assert "Traceback" not in out
    assert summary(run)["status"] == "interrupted"


def test_a_stop_is_agreed_within_stop_check_s_whatever_log_every_is(tmp_path: Path) -> None:
    # log_every 1000 > max_steps: before fault.stop_check_s the ranks agreed on a stop only at
    # a log flush, here never, and the run trained on to its end (exit 0) after SIGUSR1.
    # Every forward sleeps 0.1 s, so a step takes at least that and stop_check_s 0.5 puts the
    # agreement at most 5 steps apart: flushes (step records) appear while it trains.
    config = write_config(
        tmp_path / "c.yaml",
        train={"max_steps": 200, "log_every": 1000, "checkpoint_every": 0},
        fault={"stop_check_s": 0.5},
    )
    run = tmp_path / "run"
    slow = json.dumps({"slow": {"seconds": 0.1}})
    proc = start_train(config, run, "--nproc", "2", HPCML_FAULT_INJECT=slow)
    wait_for("2 flushes", lambda: pid_of(run, 1) and len(records(run)) >= 2, proc=proc)
    os.kill(pid_of(run, 1) or 0, signal.SIGUSR1)
    out, _ = finish(proc, 120)
    assert proc.returncode == REQUEUE_EXIT_CODE, out
    event = [r for r in records(run, "fault") if r["event"] == "preempted"]
    assert len(event) == 1 and event[0]["step"] < 200, event
    assert max(step_losses(run)) == event[0]["step"]


def start_interruptible(config: Path, run: Path, **env_extra: str) -> subprocess.Popen[str]:
    """One process started with SIGINT's default disposition: a parent started in the
    background of a shell without job control passes SIGINT on ignored; with Python's own
    handler here, the child starts with the default."""
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return start_train(config, run, **env_extra)
    finally:
        signal.signal(signal.SIGINT, outer)
