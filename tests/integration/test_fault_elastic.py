"""Elastic restart: kill -9 of one worker makes torchrun's agent restart the group, which
resumes from the newest complete checkpoint and finishes the run, bit for bit like an
uninterrupted two-rank run (CPU, fp32)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from fault_util import (
    finish,
    pid_of,
    records,
    start_train,
    step_losses,
    summary,
    wait_for,
    write_config,
)

pytestmark = pytest.mark.slow


def test_kill_9_of_a_worker_restarts_the_group_from_the_newest_checkpoint(tmp_path: Path) -> None:
    config = write_config(tmp_path / "c.yaml", train={"max_steps": 40, "checkpoint_every": 8})
    run = tmp_path / "run"
    # The uninterrupted reference runs beside it (the machine's two cores are shared alike).
    ref = start_train(config, tmp_path / "ref", "--nproc", "2")
    proc = start_train(config, run, "--nproc", "2", "--max-restarts", "2")
    wait_for(
        "a checkpoint and a few more steps",
        lambda: (run / "checkpoints" / "step-8").exists() and len(records(run)) >= 11,
        proc=proc,
    )
    victim = pid_of(run, 1)
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    out, _ = finish(proc, 240)
    assert proc.returncode == 0, out

    done = summary(run)
    assert done["status"] == "finished" and done["steps"] == 40 and done["world_size"] == 2
    # The restarted group resumed (not restarted from scratch) from a complete checkpoint...
    resumed = done["resumed_from"]
    assert resumed is not None and Path(resumed).name.startswith("step-")
    assert int(Path(resumed).name.split("-")[1]) >= 8
    # ...with new worker processes, and the log reads as one clean run of 40 steps.
    assert pid_of(run, 1) != victim
    assert [r["step"] for r in records(run)] == list(range(1, 41))
    # ...whose losses are the uninterrupted run's, bit for bit (JSON floats round-trip
    # exactly): the resume restored weights, optimizer, LR schedule, data position and RNG.
    ref_out, _ = finish(ref, 240)
    assert ref.returncode == 0, ref_out
    assert step_losses(run) == step_losses(tmp_path / "ref")
    assert done["final"] == summary(tmp_path / "ref")["final"]
