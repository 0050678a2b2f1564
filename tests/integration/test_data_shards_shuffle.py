"""Shard-aware shuffling against a real S3 server (moto's, on loopback, with its request
recorder): a shuffled epoch of a set in a bucket downloads each shard about once (issue 30:
one permutation over every sample downloaded the shards again for nearly every batch), still
visits each sample exactly once, and the global permutation it replaces is shown, on the same
server, to download many times more."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from tests.integration.s3_server import CREDENTIALS, MotoServer

from hpcml.config import DataConfig
from hpcml.data.loader import EpochLoader
from hpcml.data.shards import ShardSet, read_manifest
from hpcml.data.shards.convert import shard, shuffle_window

SEED, BATCH = 3, 16


@pytest.fixture(scope="module")
def bucket(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[MotoServer, str]]:
    """200 train samples of 3x32x32 float32 (12296 B each) in 50 shards of 4, in a bucket."""
    folder = tmp_path_factory.mktemp("shuffle")
    local = folder / "syn"
    shard("synthetic", local, shard_size="50KB", synthetic_samples=250, val_fraction=0.2)
    saved = {k: os.environ.get(k) for k in CREDENTIALS}
    os.environ.update(CREDENTIALS)
    server = MotoServer(folder)
    try:
        yield server, server.upload(local, "hpcml", "syn")
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def epoch(url: str, window: int | None) -> tuple[list[int], int]:
    """The sample ids of one shuffled epoch read by one process with no loader workers, and
    the number of shards in the set (12 batches of 16: the last 8 samples are dropped)."""
    ds = ShardSet(url, "train", with_ids=True, cache_shards=4, shuffle_shards=window)
    cfg = DataConfig(batch_size=BATCH, shard_cache=4)
    ld = EpochLoader(ds, cfg, 0, 1, SEED, False)
    ids: list[int] = []
    for _ in range(len(ld)):
        ids += [int(i) for i in ld.next()[2]]
    return ids, len(ds.files)


def test_a_shuffled_epoch_from_a_bucket_gets_each_shard_about_once(
    bucket: tuple[MotoServer, str],
) -> None:
    server, url = bucket
    window = shuffle_window(DataConfig(source="shards", path=url))  # the default for a bucket
    assert window == 3  # data.shard_cache 4, less one slot for read-ahead
    mark = len(server.requests())
    ids, shards = epoch(url, window)
    gets = len(server.shard_gets(mark))
    assert shards == 50 and len(ids) == len(set(ids)) == 192  # each sample at most once
    # Goal of issue 30: at most 1.1x the shards per epoch (here every shard exactly once:
    # the read-ahead of a batch's next shard never pushes out a shard its window still needs).
    assert gets <= 1.1 * shards, gets
    print(f"shard-aware: {gets} GETs for {shards} shards")
    # The same epoch as one permutation over all samples: far more downloads.
    mark = len(server.requests())
    ids_global, _ = epoch(url, None)
    assert len(ids_global) == len(set(ids_global)) == 192
    global_gets = len(server.shard_gets(mark))
    print(f"one permutation: {global_gets} GETs")
    assert global_gets > 3 * shards


@pytest.mark.parametrize(("world", "workers"), [(1, 2), (2, 0)])
def test_each_reading_process_fetches_its_own_shards(
    bucket: tuple[MotoServer, str], world: int, workers: int
) -> None:
    """Issue 30: each loader worker (and each rank) kept its own shard cache and read nearly
    every shard, so an epoch fetched the set once per reading process (2.6x the set with 2
    workers in the benchmark). The epoch order is now dealt so that each reading process
    reads its own run of shards: one epoch of 2 loader workers, and of 2 ranks (each its own
    ShardSet, as separate processes have), fetches at most 1.1x the set's bytes, in GETs the
    server answered, and still sees each sample at most once."""
    server, url = bucket
    sizes = {s["file"]: s["bytes"] for s in read_manifest(url)["splits"]["train"]["shards"]}
    mark = len(server.requests())
    ids: list[int] = []
    for rank in range(world):
        ds = ShardSet(url, "train", with_ids=True, cache_shards=4, shuffle_shards=3)
        cfg = DataConfig(batch_size=BATCH, shard_cache=4, num_workers=workers)
        ld = EpochLoader(ds, cfg, rank, world, SEED, False)
        for _ in range(len(ld)):
            ids += [int(i) for i in ld.next()[2]]
    gets = server.shard_gets(mark)
    fetched = sum(sizes[p.rsplit("/", 1)[1]] for p in gets)
    assert len(ids) == len(set(ids)) == 192  # 12 batches of 16 in all, each sample once
    # Goal of issue 30: at most 1.1x the set's bytes per epoch (here 50 shards of 4 samples,
    # cut into 2 pieces of whole shards: each shard once; not dealt, 71 and 94 GETs).
    print(
        f"{world} rank(s) x {workers} workers: {len(gets)} GETs, {fetched / sum(sizes.values()):.2f}x"
    )
    assert fetched <= 1.1 * sum(sizes.values()), (len(gets), fetched)
