"""The order of an epoch over a shard set, mixing a bounded number of shards at a time.

Why: one permutation over every sample (DistributedSampler's) makes any batch need any shard;
a reading process holds only `data.shard_cache` shards, so a set in a bucket is downloaded
again and again within an epoch (issue 30: 246 GETs for 10 steps of a 40-shard set). As
Mosaic Streaming, LitData and WebDataset do, the order here shuffles the shard order, then the
samples within each run of `window` consecutive shards (a bounded shuffle buffer of shards),
so a reader needs `window` shards at once and each shard once per epoch.

The order is a function of (seed, epoch) alone, like DistributedSampler's permutation, so the
elastic guarantee of `hpcml.data.loader` holds unchanged: rank r of W takes every W-th position
of it, a checkpoint stores the global position, and a resume on another world size continues
at the next unseen position (each sample once per epoch).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch


def shard_window_order(counts: Sequence[int], window: int, seed: int, epoch: int) -> np.ndarray:
    """Sample indices of one epoch: the shards (of `counts` samples each, in file order) in a
    random order, then the samples of each run of `window` of them shuffled together."""
    return shard_stream_order(counts, window, seed, epoch, [int(sum(counts))])


class Layout(NamedTuple):
    """Who reads an epoch: `world` ranks of `workers` loader workers each (0 counts as 1: the
    rank itself), taking batches of `batch` samples. A loader hands batch k of a rank to its
    worker k mod `workers` (torch's DataLoader dispatches round robin)."""

    world: int
    workers: int
    batch: int


def streams(n: int, layout: Layout) -> tuple[list[int], np.ndarray]:
    """How an epoch of `n` samples is dealt to the reading processes under `layout`: the
    lengths of its pieces (one per (rank, worker) stream, rank-major, then the tail of fewer
    than `world` samples that no rank takes), and `at`, the position in the global order of
    each sample of the pieces laid end to end. Rank r takes positions r, r + W, ... (its t-th
    sample is at t*W + r); its t-th sample is in batch t // batch, read by worker
    (t // batch) mod workers, so a stream's samples, in position order, are exactly what one
    worker of one rank reads, in the order it reads them."""
    world, workers, batch = layout.world, max(1, layout.workers), layout.batch
    per_rank = n // world
    t = np.arange(per_rank, dtype=np.int64)
    worker = (t // batch) % workers
    pieces: list[int] = []
    at: list[np.ndarray] = []
    for r in range(world):
        for j in range(workers):
            mine = t[worker == j]
            pieces.append(len(mine))
            at.append(mine * world + r)
    pieces.append(n - per_rank * world)
    at.append(np.arange(per_rank * world, n, dtype=np.int64))
    return pieces, np.concatenate(at)


def dealt_order(base_of: Callable[[list[int]], np.ndarray], n: int, layout: Layout) -> np.ndarray:
    """The global order of an epoch whose reading processes each read one contiguous piece of
    `base_of(pieces)` (a permutation of n laid out piece after piece): what stream s reads is
    piece s, in its order, so a stream needs only the shards of its piece."""
    pieces, at = streams(n, layout)
    base = base_of(pieces)
    order = np.empty(n, dtype=np.int64)
    order[at] = base
    return order


def shard_stream_order(
    counts: Sequence[int], window: int, seed: int, epoch: int, pieces: Sequence[int]
) -> np.ndarray:
    """Sample indices of one epoch cut into `pieces` (lengths, summing to the samples): the
    shards in a random order laid end to end, cut into consecutive pieces, and each piece's
    samples shuffled a run of `window` of its shards at a time. A piece holds whole shards but
    for its first and last, so the pieces share at most len(pieces) - 1 shards: each shard is
    read by one stream, the shards at a cut by two. One piece is `shard_window_order`."""
    rng = np.random.default_rng(np.random.SeedSequence([seed % 2**63, epoch]))
    starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
    shard_order = rng.permutation(len(counts))
    if len(pieces) == 1:
        return _windows(starts, shard_order, window, rng)
    sizes = np.asarray(counts, dtype=np.int64)[shard_order]
    laid = np.concatenate([np.arange(starts[k], starts[k + 1]) for k in shard_order])
    rank_of = np.repeat(np.arange(len(counts)), sizes)  # the shard's place in shard_order
    parts, at = [], 0
    for q in pieces:
        piece, ranks = laid[at : at + q], rank_of[at : at + q]
        at += q
        if q == 0:
            continue
        group = (ranks - ranks[0]) // window  # runs of `window` shards, from the piece's first
        cuts = np.flatnonzero(np.diff(group)) + 1
        for run in np.split(piece, cuts):
            rng.shuffle(run)
        parts.append(piece)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _windows(starts: np.ndarray, shard_order: np.ndarray, window: int, rng: Any) -> np.ndarray:
    parts = []
    for w in range(0, len(shard_order), window):
        run = shard_order[w : w + window]
        idx = np.concatenate([np.arange(starts[k], starts[k + 1]) for k in run])
        rng.shuffle(idx)
        parts.append(idx)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


class OrderSampler(torch.utils.data.Sampler[int]):
    """DistributedSampler's contract (`set_epoch`; rank r of W takes positions r, r+W, ...; the
    tail that does not fill a row of W is dropped) over the order `order_of(epoch)` gives."""

    def __init__(self, order_of: Callable[[int], np.ndarray], n: int, rank: int, world: int):
        self.order_of, self.n, self.rank, self.world = order_of, n, rank, world
        self.epoch = 0
        self._cached: tuple[int, np.ndarray] | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self, epoch: int) -> np.ndarray:
        if self._cached is None or self._cached[0] != epoch:
            self._cached = (epoch, self.order_of(epoch))
        return self._cached[1]

    def __len__(self) -> int:
        return self.n // self.world

    def __iter__(self) -> Iterator[int]:
        usable = self.n // self.world * self.world
        return iter(self.order(self.epoch)[self.rank : usable : self.world].tolist())
