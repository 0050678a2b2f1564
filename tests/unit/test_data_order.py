"""The shard-aware order of an epoch (`hpcml.data.shards.order`): a permutation that is a function of
(seed, epoch) alone, whose runs of `window` shards are visited one after another, and that
keeps the elastic guarantee: a resume on another world size or worker count continues at the
next unseen sample, each sample once per epoch."""

from __future__ import annotations

import bisect
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from hpcml.config import DataConfig
from hpcml.data.loader import EpochLoader, epoch_order
from hpcml.data.shards import ShardSet
from hpcml.data.shards.convert import shard
from hpcml.data.shards.order import Layout, dealt_order, shard_stream_order, shard_window_order

B, SEED, WINDOW = 8, 13, 2


def test_the_order_mixes_a_window_of_shards_at_a_time() -> None:
    counts = [7, 5, 9, 6, 8, 3, 7]  # uneven shards, as a split's last one is
    starts = np.cumsum([0, *counts])
    order = shard_window_order(counts, 3, seed=1, epoch=0)
    assert sorted(order.tolist()) == list(range(sum(counts)))  # every sample once
    assert np.array_equal(order, shard_window_order(counts, 3, seed=1, epoch=0))
    assert not np.array_equal(order, shard_window_order(counts, 3, seed=1, epoch=1))
    assert not np.array_equal(order, shard_window_order(counts, 3, seed=2, epoch=0))
    shard_of = [bisect.bisect_right(starts.tolist(), int(i)) - 1 for i in order]
    # Consecutive runs of whole shards: each shard's samples are contiguous within its run,
    # and a run (3 shards) never interleaves with the next.
    runs, seen = [], set()
    for k in shard_of:
        if k not in seen:
            seen.add(k)
            runs.append(k)
    for r in range(0, len(runs), 3):
        window = set(runs[r : r + 3])
        n = sum(counts[k] for k in window)
        begin = sum(counts[k] for k in runs[:r])
        assert set(shard_of[begin : begin + n]) == window
    # The shard order itself changes with the epoch (over 7! orders, the two seeds differ).
    first = list(dict.fromkeys(shard_of))
    other = list(dict.fromkeys(
        bisect.bisect_right(starts.tolist(), int(i)) - 1
        for i in shard_window_order(counts, 3, seed=1, epoch=1)
    ))  # fmt: skip
    assert first != other


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("order") / "s"
    # 248 train samples of 3x32x32 float32: 40 KB shards hold 3, so 83 shards.
    shard("synthetic", out, shard_size="40KB", synthetic_samples=310, val_fraction=0.2)
    return out


def loader(root: Path, rank: int = 0, world: int = 1, workers: int = 0) -> EpochLoader:
    ds = ShardSet(root, "train", cache_shards=3, with_ids=True, shuffle_shards=WINDOW)
    cfg = DataConfig(batch_size=B, num_workers=workers, persistent_workers=False)
    return EpochLoader(ds, cfg, rank, world, SEED, False)


def take(ld: EpochLoader, batches: int) -> list[int]:
    return [int(i) for _ in range(batches) for i in ld.next()[2]]


def rest_of_epoch(ld: EpochLoader) -> list[int]:
    out: list[int] = []
    while True:
        batch = ld.next()
        if ld.epoch != 0:
            return out
        out += [int(i) for i in batch[2]]


def exactly_once(parts: list[list[int]], n: int, world_after: int) -> None:
    counts = Counter(i for p in parts for i in p)
    assert max(counts.values()) == 1
    assert n - len(counts) < B * world_after  # only the new world's drop_last tail goes unseen


@pytest.mark.parametrize(
    ("before", "after", "workers"), [(2, 1, 0), (1, 2, 0), (1, 1, 2), (1, 1, 0)]
)
def test_a_resume_continues_the_shard_aware_order(
    root: Path, before: int, after: int, workers: int
) -> None:
    n = len(ShardSet(root, "train"))
    first = [loader(root, r, before) for r in range(before)]
    seen = [take(ld, 5) for ld in first]
    # The ranks' batches interleaved are the global order of the epoch, the one dealt for
    # this world size (a function of seed, epoch and layout: every rank builds the same).
    ds = first[0].dataset
    dealt = epoch_order(ds, SEED, Layout(before, 0, B), 0)
    interleaved = [seen[k % before][k // before] for k in range(5 * B * before)]
    assert interleaved == [int(ds[int(i)][2]) for i in dealt[: 5 * B * before]]
    if before == after:  # the loader state itself (0 workers), or another worker count's
        state = first[0].state_dict()
        second = [loader(root, 0, 1, workers)]
        second[0].load_state_dict(state)
    else:
        position = first[0].position()
        second = [loader(root, r, after, workers) for r in range(after)]
        for ld in second:
            ld.resume_at(position["epoch"], position["samples"], position["layout"])
    exactly_once([*seen, *(rest_of_epoch(ld) for ld in second)], n, after)


def stream_shards(order: np.ndarray, counts: list[int], layout: Layout) -> list[set[int]]:
    """The shards each (rank, worker) reads of `order` under `layout`: rank r takes positions
    r, r + W, ... in batches; batch k goes to worker k mod workers (the DataLoader's dispatch)."""
    starts = np.cumsum([0, *counts]).tolist()
    workers = max(1, layout.workers)
    out: list[set[int]] = [set() for _ in range(layout.world * workers)]
    per_rank = len(order) // layout.world // layout.batch * layout.batch  # drop_last
    for r in range(layout.world):
        for t, i in enumerate(order[r : per_rank * layout.world : layout.world]):
            j = (t // layout.batch) % workers
            out[r * workers + j].add(bisect.bisect_right(starts, int(i)) - 1)
    return out


@pytest.mark.parametrize("layout", [Layout(1, 2, 4), Layout(2, 0, 4), Layout(3, 2, 5)])
def test_a_dealt_order_gives_each_reader_its_own_shards(layout: Layout) -> None:
    """Issue 30: every loader worker of every rank read (nearly) every shard, so a set in a
    bucket was fetched once per reading process per epoch. Dealt for its layout, the epoch is
    still one permutation, and the readers share only the shards at the cuts between them."""
    counts = [6, 5, 7, 6, 6, 4, 6, 5, 7, 6, 6, 6, 3]  # uneven, as a split's shards are
    n = sum(counts)
    order = dealt_order(lambda pieces: shard_stream_order(counts, 3, SEED, 0, pieces), n, layout)
    assert sorted(order.tolist()) == list(range(n))  # each sample once per epoch
    reads = stream_shards(order, counts, layout)
    readers = len(reads)
    assert sum(len(s) for s in reads) <= len(counts) + readers - 1  # the cuts, no more
    # One permutation over the same samples (the order before dealing) makes every reader
    # read most shards: the bound above is what the dealing buys.
    plain = shard_window_order(counts, 3, SEED, 0)
    assert sum(len(s) for s in stream_shards(plain, counts, layout)) > 1.5 * len(counts)


def test_one_piece_is_the_window_order() -> None:
    """Positions saved before orders were dealt (no layout) replay the order they were in."""
    counts = [7, 5, 9, 6, 8, 3, 7]
    assert np.array_equal(
        shard_stream_order(counts, 3, 1, 0, [sum(counts)]), shard_window_order(counts, 3, 1, 0)
    )


def test_a_second_resume_mid_remainder_keeps_the_layout_it_was_dealt_for(root: Path) -> None:
    """2 ranks take 4 batches; 3 ranks with 2 loader workers continue for 2 and save (their
    remainder is the order dealt for 2 ranks); 1 rank continues from that state. Forgetting
    the layout at either resume replays another order: samples twice and samples never."""
    n = len(ShardSet(root, "train"))
    two = [loader(root, r, 2) for r in range(2)]
    seen = [i for ld in two for i in take(ld, 4)]
    position = two[0].position()
    assert position["layout"] == [2, 0, B]
    three = [loader(root, r, 3, 2) for r in range(3)]
    for ld in three:
        ld.resume_at(position["epoch"], position["samples"], position["layout"])
    seen += [i for ld in three for i in take(ld, 2)]
    state = three[0].state_dict()
    assert state["layout"] == [2, 0, B] and state["remainder_at"] == 4 * B * 2 + 2 * B * 3
    (one,) = [loader(root)]
    one.load_state_dict(state)
    exactly_once([seen, rest_of_epoch(one)], n, 1)
    assert one.next() is not None and one.position()["layout"] == [1, 0, B]  # epoch 1: its own


def test_augmenting_keeps_the_dealt_shard_order(root: Path) -> None:
    """data.augment wraps the training set (AugmentedImages); the wrapper hid the shard set's
    epoch order, so an augmented set in a bucket was read in one permutation over every
    sample (any batch, any shard). Wrapped, the loader draws the bare set's dealt order."""
    from hpcml.data.sources import AugmentedImages

    bare = loader(root, 0, 2)
    ds = ShardSet(root, "train", cache_shards=3, shuffle_shards=WINDOW)
    cfg = DataConfig(batch_size=B, num_workers=0, persistent_workers=False)
    wrapped = EpochLoader(AugmentedImages(ds), cfg, 0, 2, SEED, False)
    assert wrapped.position()["layout"] == [2, 0, B]
    assert list(wrapped.sampler) == list(bare.sampler)  # rank 0 of 2, epoch 0
    x, _ = wrapped.next()  # and it reads: augmented images of the set's shape
    assert x.shape == (B, 3, 32, 32)
