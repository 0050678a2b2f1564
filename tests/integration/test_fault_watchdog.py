"""The watchdog never sleeps through checkpoint I/O: a save stalled in one phase (a hung
filesystem, injected through HPCML_FAULT_INJECT's ckpt_stall) ends the job with a sentence
naming the rank and the phase within fault.checkpoint_timeout_s, and SIGTERM during a stalled
save ends it within fault.preempt_grace_s instead of waiting for a SIGKILL."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from fault_util import (
    config_dict,
    finish,
    records,
    start_engine,
    start_train,
    summary,
    wait_for,
    write_config,
)

from hpcml.train.checkpoint import store as ckpt

pytestmark = pytest.mark.slow


def stall(**spec: object) -> dict[str, str]:
    return {"HPCML_FAULT_INJECT": json.dumps({"ckpt_stall": {"seconds": 3600, **spec}})}


@pytest.mark.parametrize(
    ("phase", "background"),
    [("write", False), ("fsync", True), ("manifest", False), ("rename", True)],
)
def test_a_save_stalled_in_one_phase_ends_the_run_naming_rank_and_phase(
    tmp_path: Path, phase: str, background: bool
) -> None:
    # The stall is an hour; the run must end on fault.checkpoint_timeout_s (2 s). The join
    # below (120 s) fails the test if only something else could have ended it.
    run = tmp_path / "run"
    cfg = config_dict(
        train={"max_steps": 100_000, "checkpoint_every": 3, "checkpoint_async": background},
        fault={"checkpoint_timeout_s": 2},
    )
    proc, _ = start_engine(cfg, run, **stall(phase=phase))
    proc.join(timeout=120)
    if proc.is_alive():
        proc.kill()
        raise AssertionError(f"a save stalled in {phase} did not end the run")
    assert proc.exitcode == 1
    failed = summary(run)
    assert failed["status"] == "failed"
    assert failed["error"].startswith(
        f"rank 0 stalled in the {phase} phase of the checkpoint of step 3 for "
    ), failed["error"]
    assert "fault.checkpoint_timeout_s=2" in failed["error"]
    assert ckpt.find_latest(run / "checkpoints") is None  # the stalled one never completed


def test_sigterm_during_a_stalled_background_save_ends_both_ranks_within_the_grace_time(
    tmp_path: Path,
) -> None:
    # Rank 0's background finalize of step 5 hangs in fsync; training goes on until the next
    # save waits for it. A SIGTERM then cannot be honoured with a checkpoint: the run ends
    # after fault.preempt_grace_s (3 s) naming rank 0 and the phase, exit 1 (not 75: nothing
    # was saved for it), long before the checkpoint timeout (1 h) or torchrun's SIGKILL (120 s).
    config = write_config(
        tmp_path / "c.yaml",
        train={"max_steps": 100_000, "checkpoint_every": 5, "checkpoint_async": True},
        fault={"checkpoint_timeout_s": 3600, "preempt_grace_s": 3},
    )
    run = tmp_path / "run"
    proc = start_train(config, run, "--nproc", "2", **stall(rank=0, phase="fsync", step=5))
    wait_for(
        "the stalled save and the next one waiting for it",
        lambda: (run / "checkpoints" / ".step-5.tmp").exists() and len(records(run)) >= 10,
        proc=proc,
    )
    proc.send_signal(signal.SIGTERM)
    out, _ = finish(proc, 100)
    assert proc.returncode == 1, out
    assert "rank 0 stalled in the fsync phase of the checkpoint of step 5" in out
    assert "when a preemption signal came" in out and "fault.preempt_grace_s=3" in out
    assert summary(run)["status"] == "failed"
    assert "preempted by" not in out
