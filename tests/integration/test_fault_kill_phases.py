"""kill -9 at every phase of a two-rank save (issue 11, item 6), synchronous and background.

Each attempt is a real two-rank gloo group: two processes forked from a server that imported
the engine once (fault_util.engine_context: starting 20 groups through torchrun costs about
20 s of imports each on two busy cores), each running `hpcml.train.engine.run` with
RANK/WORLD_SIZE set as torchrun sets them. The injector (HPCML_FAULT_INJECT `ckpt_kill`, a
list: entry i for attempt i, from TORCHELASTIC_RESTART_COUNT as torchrun numbers restarts)
kills one rank with SIGKILL as a phase of a save begins, or at a point inside one; the test
then kills the other rank with SIGKILL (what torchrun's agent does to the survivors) and
starts the next attempt with --resume auto, which is killed at a later save: ten kills per
mode, twenty in all. (A restart through torchrun's agent, `hpcml train --nproc 2
--max-restarts`, is tested in test_fault_elastic.py, with the same loss comparison.)

  hash     after the DCP write, before this rank hashed its files (rank 0 or rank 1)
  fsync    every rank's files written and hashed, not yet fsynced
  manifest after fsync, before the manifest
  rename   after the manifest, before the rename
  renamed  during the rename: the folder renamed, its parent not yet fsynced
  prune    after the rename, before retention pruning
  pruning  during pruning: an old checkpoint renamed away, not yet deleted

After every kill, the checkpoint `--resume auto` takes must be the newest complete one (the
previous save for a kill before the rename, this save from the rename on), and the run must
end bit for bit where an uninterrupted run ends (CPU, fp32: every step's loss, the final
evaluation).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from fault_util import (
    config_dict,
    start_engine,
    step_losses,
    summary,
)

from hpcml.train import rundir
from hpcml.train.checkpoint import store as ckpt

pytestmark = pytest.mark.slow

EVERY = 2
# (phase, rank) per attempt; attempt i is killed at the save of step FIRST + EVERY * i.
TRIALS = [
    ("hash", 0),
    ("hash", 1),
    ("fsync", 0),
    ("manifest", 0),
    ("rename", 0),
    ("renamed", 0),
    ("prune", 0),
    ("pruning", 0),
    ("hash", 1),
    ("renamed", 0),
]
FIRST = 4
MAX_STEPS = FIRST + EVERY * len(TRIALS) + 2
SAVED = {"renamed", "prune", "pruning"}  # the save being killed is already complete
SECTIONS: dict[str, dict[str, Any]] = {
    "optim": {"decay_steps": 1000},  # one LR horizon for every attempt
    "train": {"max_steps": MAX_STEPS, "checkpoint_every": EVERY, "keep_last": 2},
    "fault": {"straggler_every": 0},
}


def _drills(trials: list[tuple[str, int]]) -> str:
    kills = [
        {"phase": phase, "rank": rank, "step": FIRST + EVERY * i}
        for i, (phase, rank) in enumerate(trials)
    ]
    return json.dumps({"ckpt_kill": kills})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_group(cfg: dict[str, Any], run: Path, attempt: int, drills: str) -> list[int | None]:
    """One attempt of a two-rank group; returns the ranks' exit codes (-9: SIGKILL)."""
    port = str(_free_port())
    procs, queues = [], []  # the queues must outlive the children's start (their semaphores)
    for rank in range(2):
        env = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "2",
            "TORCHELASTIC_RESTART_COUNT": str(attempt),
            "HPCML_FAULT_INJECT": drills,
        }
        proc, results = start_engine(cfg, run, "auto" if attempt else None, **env)
        procs.append(proc)
        queues.append(results)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and all(p.is_alive() for p in procs):
        time.sleep(0.02)
    for p in procs:  # the agent's part: a rank died, the group goes
        if p.is_alive() and any(q.exitcode == -signal.SIGKILL for q in procs if q is not p):
            os.kill(p.pid, signal.SIGKILL)
        p.join(timeout=120)
    del queues
    return [p.exitcode for p in procs]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ref = tmp_path_factory.mktemp("ref") / "run"
    assert run_group(config_dict(**SECTIONS), ref, 0, "{}") == [0, 0]
    return ref


@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
def test_kill_9_at_every_phase_of_a_two_rank_save_resumes_bit_exact(
    tmp_path: Path, reference: Path, background: bool
) -> None:
    cfg = config_dict(**SECTIONS)
    cfg["train"]["checkpoint_async"] = background
    run = tmp_path / "run"
    drills = _drills(TRIALS)
    for attempt, (phase, rank) in enumerate(TRIALS):
        codes = run_group(cfg, run, attempt, drills)
        assert codes[rank] == -signal.SIGKILL, (attempt, phase, codes)
        # What --resume auto takes now: the newest complete checkpoint.
        step = FIRST + EVERY * attempt
        newest = step if phase in SAVED else step - EVERY
        chosen = rundir.resolve(run, "auto", False, dry_run=True)
        assert chosen == run / "checkpoints" / f"step-{newest}", (attempt, phase)
        assert ckpt.verify(chosen) is None
    assert run_group(cfg, run, len(TRIALS), drills) == [0, 0]

    done = summary(run)
    assert done["status"] == "finished" and done["steps"] == MAX_STEPS
    assert done["resumed_from"] == str(run / "checkpoints" / f"step-{newest}")
    # Bit for bit against the uninterrupted run (JSON floats round-trip exactly).
    assert sorted(step_losses(run)) == list(range(1, MAX_STEPS + 1))
    assert step_losses(run) == step_losses(reference)
    assert done["final"] == summary(reference)["final"]
    # Nothing half-written or half-deleted is left, and the kept checkpoints verify.
    root = run / "checkpoints"
    assert not list(root.glob(".step-*"))
    kept = ckpt.list_saved(root)
    assert [p.name for p in kept] == [f"step-{MAX_STEPS}", f"step-{MAX_STEPS - EVERY}"]
    assert all(ckpt.verify(p) is None for p in kept)
