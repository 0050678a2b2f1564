"""Bounded memory: a process whose address space may grow by only 80 MiB past its size after
warm-up streams a whole epoch of a 240 MiB shard set (3x the margin); the same process keeping
every shard open fails under the same limit, so the limit does bind.

What the reader needs inside the margin: two 8 MiB maps (cache_shards=2) and one batch of 16
samples (16 x 192 KiB of float32, twice while scaled and stacked: about 6 MiB), plus what the
heap keeps after freeing; measured 31-44 MiB over 12 runs on the 2-core EPYC (MALLOC_ARENA_MAX=1),
so 80 MiB leaves about 2x. MALLOC_ARENA_MAX=1 because glibc reserves 64 MiB of address space for
each thread's own malloc arena, created when a thread (torch's or Arrow's pool) first allocates:
a fixed, timing-dependent cost that made the same run grow 31 or 156 MiB, and that does not grow
with the data.

Why a limit relative to the process: torch and pyarrow alone map several hundred MB of address
space (libraries, thread stacks) that do not depend on the data; an absolute limit would test
those, not the reader. RLIMIT_AS (address space) rather than RSS because Linux does not enforce
RLIMIT_RSS, and memory-mapped shards count in the address space while they are mapped."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tests.conftest import ROOT, hpcml_env

from hpcml.data import shards

CHILD = Path(__file__).with_name("shards_memory_child.py")
SHAPE = (3, 128, 128)  # uint8: 48 KiB a sample
N = 5_120  # 5,120 x 48 KiB = 240 MiB (about 252 MB) of training samples
MARGIN_MB = 80


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mem") / "shards"

    def items(n: int, offset: int):
        for i in range(n):
            # Content keyed by id (cheap to make; the reader's ids come from the id column).
            yield i, np.full(SHAPE, (i + offset) % 251, np.uint8), np.asarray(i % 10, np.int64)

    header = {
        "sample": {
            "layout": "tensor",
            "x": shards.spec(np.uint8, SHAPE),
            "y": shards.spec(np.int64, ()),
        },
        "num_classes": 10,
        "source": {"name": "test"},
        "transform": {"read": {"scale": 1 / 255}},
    }
    shards.write_shard_set(
        out,
        {"train": items(N, 0), "val": items(64, 7)},
        header,
        shard_bytes=8 * 2**20,
        compression="none",
    )
    return out


def run_child(root: Path, cache_shards: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            str(CHILD),
            "--shards",
            str(root),
            "--margin-mb",
            str(MARGIN_MB),
            "--cache-shards",
            str(cache_shards),
        ],
        cwd=ROOT,
        env=hpcml_env(MALLOC_ARENA_MAX="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_an_epoch_larger_than_the_memory_limit_streams_to_the_end(big):
    size = sum(p.stat().st_size for p in big.glob("train-*.arrow"))
    assert size >= 3 * MARGIN_MB * 2**20  # the data is 3x what the process may add
    proc = run_child(big, cache_shards=2)  # 2 maps of ~8 MiB: well inside the margin
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["count"] == out["distinct"] == N  # every sample once: drop_last tail is 0 (N % 16)


def test_the_limit_binds_a_reader_that_keeps_every_shard(big):
    proc = run_child(big, cache_shards=10_000)  # every shard stays mapped: 240 MiB > 80 MiB
    assert proc.returncode != 0
    assert "cannot be read" in proc.stderr or "MemoryError" in proc.stderr, proc.stderr[-2000:]
