"""Crash-safe checkpoints: kill -9 of the writer at random points never leaves a run that cannot
resume; a corrupted checkpoint is reported in one sentence and the previous one is used."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
from fault_util import (
    config_dict,
    pid_of,
    records,
    run_engine,
    run_train,
    start_engine,
    summary,
    wait_for,
    write_config,
)

from hpcml.train import rundir
from hpcml.train.checkpoint import store as ckpt

pytestmark = pytest.mark.slow

TRIALS = 12


def newest_step(root: Path) -> int:
    latest = ckpt.find_latest(root)
    return ckpt.step_of(latest) or 0 if latest is not None else 0


def test_kill_9_at_random_points_of_checkpoint_writes_never_breaks_resume(tmp_path: Path) -> None:
    rng = random.Random(20240611)
    run = tmp_path / "run"
    root = run / "checkpoints"
    # A checkpoint every step, so most of the time is spent writing one; sync and background
    # (async) writes alternate between trials.
    # One LR horizon for every trial and the final resume (a changed horizon is refused).
    horizon = {"decay_steps": 100_000}
    cfg = config_dict(
        optim=horizon, train={"max_steps": 100_000, "checkpoint_every": 1, "keep_last": 2}
    )
    partial_left = 0
    resumed_at: list[int] = []
    for trial in range(TRIALS):
        cfg["train"]["checkpoint_async"] = trial % 2 == 1
        before = newest_step(root)
        proc, _ = start_engine(cfg, run, resume="auto" if trial else None)
        # Each trial resumes (--resume auto) from what the previous kill left, then trains on.
        # (Its pid file appears after the resume has cut run.jsonl back to the checkpoint.)
        # The first trial also waits for its first complete checkpoint: a step record comes
        # before that step's save ends, so a kill right after step 1 can leave nothing to
        # resume from (on a busy machine it did), which is no fault of the writes under test.
        wait_for(
            f"trial {trial} to train past step {before}",
            lambda b=before, p=proc: (
                pid_of(run, 0) == p.pid
                and any(r["step"] > b for r in records(run))
                and ckpt.find_latest(root) is not None
            ),
            timeout=60,
        )
        assert proc.is_alive(), f"trial {trial}: the run ended before the kill ({proc.exitcode})"
        time.sleep(rng.uniform(0.0, 0.6))  # a random point of this write or one of the next
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(timeout=30)
        assert proc.exitcode == -signal.SIGKILL
        partial_left += any(root.glob(".step-*.tmp"))

        # What --resume auto would choose is complete and verifies, every time.
        chosen = rundir.resolve(run, "auto", False)
        assert chosen is not None and ckpt.verify(chosen) is None
        resumed_at.append(ckpt.step_of(chosen) or 0)

    # The kills did land inside writes (a partial folder was left behind), and training made
    # progress across trials instead of losing more than the write in flight.
    assert partial_left >= TRIALS // 3, partial_left
    assert resumed_at == sorted(resumed_at) and resumed_at[-1] > resumed_at[0]

    # The real command resumes from what the last kill left and finishes.
    last = resumed_at[-1]
    config = write_config(
        tmp_path / "c.yaml",
        optim=horizon,
        train={"max_steps": last + 3, "checkpoint_every": 1, "keep_last": 2},
    )
    done = run_train(config, run, "--resume", "auto")
    assert done.returncode == 0, done.stderr
    assert summary(run)["status"] == "finished" and summary(run)["steps"] == last + 3
    assert summary(run)["resumed_from"] == str(root / f"step-{last}")
    assert not list(root.glob(".step-*.tmp"))  # the next save cleans partial folders up


def test_a_corrupted_checkpoint_is_reported_and_the_previous_one_used(tmp_path: Path) -> None:
    run = tmp_path / "run"
    horizon = {"decay_steps": 14}  # both runs: a changed LR horizon is refused on resume
    first = run_engine(
        config_dict(optim=horizon, train={"max_steps": 12, "checkpoint_every": 4}), run
    )
    assert first == ("ok", "finished")
    newest = run / "checkpoints" / "step-12"
    shard = next(newest.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same size: only the sha256 can tell
    shard.write_bytes(bytes(data))

    config = write_config(
        tmp_path / "c.yaml", optim=horizon, train={"max_steps": 14, "checkpoint_every": 4}
    )
    again = run_train(config, run, "--resume", "auto")
    assert again.returncode == 0, again.stderr
    warning = [line for line in again.stderr.splitlines() if "sha256" in line]
    assert len(warning) == 1
    assert f"{newest}: {shard.name} does not match its sha256" in warning[0]
    assert "using the previous complete checkpoint" in warning[0]
    # Moved aside, not deleted, and not overwritten when the run saved step 12 again.
    assert f"moved it to {run / 'checkpoints' / 'corrupt' / 'step-12'}" in warning[0]
    assert (run / "checkpoints" / "corrupt" / "step-12" / shard.name).read_bytes() == bytes(data)
    assert summary(run)["resumed_from"] == str(run / "checkpoints" / "step-8")
    assert [r["step"] for r in records(run)] == list(range(1, 15))


def test_resume_auto_with_only_corrupt_checkpoints_refuses_then_allow_fresh_start_keeps_them(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    first = run_engine(config_dict(train={"max_steps": 8, "checkpoint_every": 4}), run)
    assert first == ("ok", "finished")
    for step in (4, 8):
        shard = next((run / "checkpoints" / f"step-{step}").glob("*.distcp"))
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    before = {p: p.read_bytes() for p in (run / "checkpoints").rglob("*") if p.is_file()}

    config = write_config(tmp_path / "c.yaml", train={"max_steps": 10, "checkpoint_every": 4})
    refused = run_train(config, run, "--resume", "auto", "--nproc", "2")
    assert refused.returncode == 2, refused.stderr
    assert (
        "none of the 2 checkpoint(s)" in refused.stderr and "--allow-fresh-start" in refused.stderr
    )
    assert "Traceback" not in refused.stderr
    after = {p: p.read_bytes() for p in (run / "checkpoints").rglob("*") if p.is_file()}
    assert after == before  # a refusal changes nothing

    fresh = run_train(config, run, "--resume", "auto", "--allow-fresh-start")
    assert fresh.returncode == 0, fresh.stderr
    assert fresh.stderr.count("moved it to") == 2
    assert summary(run)["resumed_from"] is None and summary(run)["steps"] == 10
    kept = {
        p.relative_to(run / "checkpoints" / "corrupt"): p.read_bytes()
        for p in (run / "checkpoints" / "corrupt").rglob("*")
        if p.is_file()
    }
    assert kept == {p.relative_to(run / "checkpoints"): b for p, b in before.items()}


def test_time_based_checkpoints_save_once_the_interval_has_passed(tmp_path: Path) -> None:
    # Each step sleeps 30 ms in forward (injected), so 50 ms have always passed after two steps:
    # with checkpoint_every 0, train.checkpoint_every_s alone must save at least every 2 steps.
    run = tmp_path / "run"
    cfg = config_dict(
        train={"max_steps": 12, "checkpoint_every": 0, "checkpoint_every_s": 0.05,
               "keep_last": 100},
    )  # fmt: skip
    outcome = run_engine(cfg, run, HPCML_FAULT_INJECT='{"slow": {"seconds": 0.03}}')
    assert outcome == ("ok", "finished")
    steps = sorted(ckpt.step_of(p) or 0 for p in ckpt.list_complete(run / "checkpoints"))
    assert steps[-1] == 12 and len(steps) >= 6, steps
    assert all(b - a <= 2 for a, b in zip([0, *steps], steps, strict=False)), steps
