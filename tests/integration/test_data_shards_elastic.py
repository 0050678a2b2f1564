"""Elastic determinism with shards: the order of an epoch depends on (seed, epoch) only, and a
resume mid-epoch from 1 to 2 processes (torchrun, gloo), from 2 to 1, and from 0 to 2 loader
workers sees every remaining sample of the epoch exactly once. Sample ids come from the shards'
id column, so they are what was read, not the indices asked for. One torchrun launch serves
both directions; the 1-process halves run in this process."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from tests.conftest import ROOT, hpcml_env

from hpcml.config import DataConfig
from hpcml.data.loader import EpochLoader
from hpcml.data.shards import ShardSet
from hpcml.data.shards.convert import shard

N, B, SEED = 248, 8, 11  # 310 synthetic samples less 62 (val_fraction 0.2)
WORKER = Path(__file__).with_name("shards_elastic_worker.py")


def ids(batch) -> list[int]:
    return [int(i) for i in batch[2]]


def loader(root: Path, rank: int = 0, world: int = 1, workers: int = 0) -> EpochLoader:
    ds = ShardSet(root, "train", cache_shards=2, with_ids=True)
    cfg = DataConfig(batch_size=B, num_workers=workers, persistent_workers=False)
    return EpochLoader(ds, cfg, rank, world, SEED, False)


def rest_of_epoch(ld: EpochLoader) -> list[int]:
    out: list[int] = []
    while True:
        batch = ld.next()
        if ld.epoch != 0:
            return out
        out += ids(batch)


def check_exactly_once(before: list[int], after: list[int], world_after: int) -> None:
    counts = Counter(before + after)
    assert max(counts.values()) == 1, [i for i, c in counts.items() if c > 1]  # multiset
    assert set(counts) <= set(range(N))
    # Only the new world's drop_last tail (fewer than one global batch) may go unseen.
    assert N - len(counts) < B * world_after, (N, len(counts))


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("elastic") / "shards"
    # 248 train + 62 val samples of 3x4x4 float32 (192 B + 8 B label): 2 KB shards hold 10: 25+ shards.
    shard("synthetic", out, shard_size="2KB", synthetic_samples=310, val_fraction=0.2)
    return out


def test_resume_across_world_sizes_and_workers_sees_each_sample_once(root, tmp_path):
    assert len(ShardSet(root, "train")) == N
    # 1 process takes 7 batches; its position is where 2 processes continue.
    one = loader(root)
    one_first = [i for _ in range(7) for i in ids(one.next())]
    pos1 = one.position()
    assert pos1 == {"epoch": 0, "samples": 7 * B}

    out = tmp_path / "ranks.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(WORKER),
            "--shards",
            str(root),
            "--out",
            str(out),
            "--batch",
            str(B),
            "--seed",
            str(SEED),
            "--resume-samples",
            str(pos1["samples"]),
            "--take",
            "5",
        ],
        cwd=ROOT,
        env=hpcml_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())
    ranks = sorted(got["ranks"], key=lambda r: r["rank"])

    # 1 -> 2: the two ranks' remainders complete the 1-process epoch start.
    check_exactly_once(one_first, [i for r in ranks for b in r["rest"] for i in b], 2)

    # Order depends on (seed, epoch) only: rank r of 2 takes global positions r, r+2, ...
    # (batch t holds positions 2(tB + m) + r), so interleaving the ranks rebuilds the 1-process
    # order sample by sample.
    fresh_one = loader(root)
    single = [i for _ in range(10) for i in ids(fresh_one.next())]
    interleaved = [ranks[k % 2]["first"][(k // 2) // B][(k // 2) % B] for k in range(10 * B)]
    assert interleaved == single

    # 2 -> 1: one process continues the 2-process epoch from its global position.
    assert got["position"] == {"epoch": 0, "samples": 5 * B * 2}
    alone = loader(root)
    alone.resume_at(0, got["position"]["samples"])
    check_exactly_once([i for r in ranks for b in r["first"] for i in b], rest_of_epoch(alone), 1)

    # num_workers 0 -> 2 on the same world size: the loader state a 0-worker run saved.
    zero = loader(root)
    before = [i for _ in range(6) for i in ids(zero.next())]
    state = zero.state_dict()
    two = loader(root, workers=2)
    two.load_state_dict(state)
    check_exactly_once(before, rest_of_epoch(two), 1)


def test_the_rest_of_an_epoch_after_a_resume_is_read_in_loader_workers(root):
    """Issue 30: after a resume on another worker count or world size the rest of the epoch
    ran with num_workers=0 (the remainder loader hard-coded it), so the training process read
    every shard itself. Here the shard set object of this process must open no shard: the
    loader workers (forked copies) do the reading, and the samples are the 0-worker ones."""
    zero = loader(root)
    for _ in range(6):
        zero.next()
    state = zero.state_dict()  # saved by a 0-worker run

    def resumed(workers: int, how: str) -> tuple[list[int], int]:
        ld = loader(root, workers=workers)
        if how == "workers":  # 0 -> `workers` loader workers, same world size
            ld.load_state_dict(state)
        else:  # 2 -> 1 processes: the global position two ranks of 5 batches left
            ld.resume_at(0, 5 * B * 2)
        rest = rest_of_epoch(ld)
        return rest, len(ld.dataset.slots)  # type: ignore[attr-defined]

    for how in ("workers", "world"):
        inline, opened_inline = resumed(0, how)
        in_workers, opened_here = resumed(2, how)
        assert opened_inline > 0  # the check can see reading in this process
        assert opened_here == 0, f"{how}: this process opened {opened_here} shards itself"
        assert in_workers == inline  # same samples, same order
