"""Host reads and collectives of every training step under tensor parallelism, zero3, and a
BatchNorm model under ddp (the MLP under ddp: test_step_communication.py).

2 gloo processes, the fault guard at its defaults with a straggler check every 4 steps,
gradient clipping on. Counted in-process over every step but the last (steps 1..12: the last
also evaluates and saves), from the first step's set-up on:
- host reads: `.item()`, `.tolist()`, `bool()`, `int()`, `float()` and `index` of a tensor
  (patched on torch.Tensor: every thread, every caller but the data pipeline's, whose CPU
  tensors never were on the device: the sampler's order and the loader's seed at an epoch's
  start);
- Python-level collectives of torch.distributed, and DDP's buffer broadcasts
  (`dist._broadcast_coalesced`, which DDP calls before each forward when it broadcasts
  buffers). The model's own communication (DDP's gradient all-reduce, FSDP's and tensor
  parallelism's collectives) is the training's, not the loop's, and is not counted.

The budget: one host read and one collective per log flush (the first step's flush measures
the step time for `fault.stop_check_s`; then every `log_every`) and per straggler check (no
rank is slow here: the check's second collective, for the slow ranks' hosts, never runs).
Anything per step shows up as a dozen.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from tests import forked
from tests.conftest import summary

pytestmark = pytest.mark.slow

STEPS, LOG_EVERY, STRAGGLER_EVERY = 13, 4, 4
WINDOW = range(1, STEPS)  # steps 1..12
FLUSHES = 1 + len([s for s in WINDOW if s % LOG_EVERY == 0])  # step 1, then 4, 8, 12
CHECKS = len([s for s in WINDOW if s % STRAGGLER_EVERY == 0])
READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "gather_object",
    "all_to_all",
    "_broadcast_coalesced",
)
OWN_ONLY = ("all_gather_single",)
"""Counted only when hpcml calls it (the straggler check): FSDP2 gathers parameters with it."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


DATA_PIPELINE = ("torch/utils/data/", "torchdata/", "hpcml/data/")


def _count(counts: dict[str, int], key: str, fn: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1).f_code.co_filename
        if key == "read" and any(part in caller for part in DATA_PIPELINE):
            pass
        elif key != "own_collective" or "/hpcml/" in caller:
            counts["read" if key == "read" else "collective"] += 1
        return fn(*args, **kwargs)

    return wrapper


def _worker(
    rank: int, port: int, run_dir: str, queue: Any, overrides: list[str]
) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import torch.distributed as dist

    from hpcml.config import load_config
    from hpcml.train.hooks import Hook, Hooks
    from hpcml.train.trainer import Trainer

    torch.set_num_threads(1)
    counts = {"read": 0, "collective": 0}
    for name in READS:
        setattr(torch.Tensor, name, _count(counts, "read", getattr(torch.Tensor, name)))
    for name in COLLECTIVES:
        setattr(dist, name, _count(counts, "collective", getattr(dist, name)))
    for name in OWN_ONLY:
        setattr(dist, name, _count(counts, "own_collective", getattr(dist, name)))
    seen: dict[int, dict[str, int]] = {}

    class Snapshot(Hook):
        rank_zero_only = False

        def before_step(self, trainer: Any) -> None:
            seen[trainer.step] = dict(counts)

    cfg = load_config(
        "examples/digits_cnn.yaml",
        [
            f"train.max_steps={STEPS}",
            f"train.log_every={LOG_EVERY}",
            "train.eval_every=0",
            "train.checkpoint_every=0",
            "optim.grad_clip=0.5",
            "fault.watchdog_s=0",
            f"fault.straggler_every={STRAGGLER_EVERY}",
            "fault.straggler_factor=1000",  # checked, never reported (no extra log lines)
            "fault.stop_check_s=3600",  # no stop-check flush but the first step's
            *overrides,
        ],
    )
    Trainer(cfg, run_dir=Path(run_dir), quiet=True, hooks=Hooks([Snapshot()])).fit()
    first, last = WINDOW[0] - 1, WINDOW[-1]  # before step 1 .. before step 13
    queue.put((rank, {k: seen[last][k] - seen[first][k] for k in counts}))


def _run(run_dir: Path, overrides: list[str]) -> dict[int, dict[str, int]]:
    # Forked from tests/forked.py's server, which imported torch and the trainer once.
    queue = forked.server_context().SimpleQueue()
    forked.start_ranks(_worker, (_free_port(), str(run_dir), queue, overrides))
    return dict(queue.get() for _ in range(2))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hpcml.data.sources.tokens import prepare_pystdlib

    path = tmp_path_factory.mktemp("syncs") / "corpus"
    prepare_pystdlib(path, val_fraction=0.2, max_bytes=100_000)
    return path


def _gpt(corpus: Path) -> list[str]:
    return [
        "model.name=gpt-tiny",
        "data.source=tokens",
        f"data.path={corpus}",
        "data.seq_len=32",
        "data.batch_size=8",
        "data.eval_windows=24",
    ]


LAYOUTS = {
    # gpt-tiny's vocabulary (256) is padded to no more: tp keeps its logits sharded either way.
    "tp": ["parallel.tp=2", "parallel.sequence_parallel=true", "train.eval_batch_size=6"],
    "zero3": ["parallel.strategy=zero3"],
    "batchnorm_ddp": ["model.name=simple_cnn", "data.batch_size=16"],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_no_host_read_or_collective_per_step(tmp_path: Path, corpus: Path, layout: str) -> None:
    gpt = _gpt(corpus) if layout != "batchnorm_ddp" else []
    per_rank = _run(tmp_path / "run", [*gpt, *LAYOUTS[layout]])
    for rank, got in per_rank.items():
        assert got["read"] <= FLUSHES + CHECKS, (rank, got)
        assert got["collective"] == FLUSHES + CHECKS, (rank, got)
    if layout == "tp":  # train.eval_batch_size: 24 windows in batches of 6 (one replica)
        assert summary(tmp_path / "run")["final"]["val_batches_per_rank"] == 4
