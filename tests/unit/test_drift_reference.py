"""The drift reference of a shard set reads a bounded number of shards (a remote set would
otherwise fetch one whole shard per reference sample), and is still a profile of its rows."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from hpcml.data import shards
from hpcml.data.drift import (
    REFERENCE_MIN_SHARDS,
    REFERENCE_ROWS_PER_SAMPLE,
    profile_dataset,
    reference_indices,
)
from hpcml.data.shards.convert import shard


def _shard_set(tmp_path: Path) -> shards.ShardSet:
    # 4,000 synthetic samples of 3x32x32 float32 (12 KB): 200 KB shards hold 16 each, so 200
    # train shards.
    out = tmp_path / "s"
    shard("synthetic", out, shard_size="200KB", val_fraction=0.2, synthetic_samples=4000)
    return shards.ShardSet(out, "train")


def test_a_shard_sets_reference_reads_a_bounded_number_of_shards(tmp_path: Path) -> None:
    ds = _shard_set(tmp_path)
    per_shard = min(ds.counts[:-1])  # the last shard holds the split's remainder
    assert len(ds.counts) >= 200 and per_shard >= 16
    samples = 100
    idx = reference_indices(ds, samples, np.random.default_rng(0))
    touched = {ds.shard_of(int(i)) for i in idx}
    # Shards are added until they hold 4 rows per sample and at least 32 shards: with >= 16
    # rows a shard 25 would hold 400, so 32; one more if the short last shard is among them.
    bound = max(REFERENCE_MIN_SHARDS, math.ceil(REFERENCE_ROWS_PER_SAMPLE * samples / per_shard))
    assert len(touched) <= bound + 1, len(touched)
    # Drawn uniformly over the whole set instead (main), 100 samples land in ~80 of the 200 shards.
    uniform = np.random.default_rng(0).choice(len(ds), size=samples, replace=False)
    assert len({ds.shard_of(int(i)) for i in uniform}) > 2 * (bound + 1)
    assert len(idx) == samples and len(set(idx.tolist())) == samples
    assert list(idx) == sorted(idx)  # read in file order
    # Seeded: the same indices again; another seed, other shards.
    assert np.array_equal(idx, reference_indices(ds, samples, np.random.default_rng(0)))
    other = reference_indices(ds, samples, np.random.default_rng(1))
    assert {ds.shard_of(int(i)) for i in other} != touched


def test_a_small_or_plain_dataset_is_sampled_uniformly(tmp_path: Path) -> None:
    plain = list(range(500))
    idx = reference_indices(plain, 50, np.random.default_rng(3))
    want = np.sort(np.random.default_rng(3).choice(500, size=50, replace=False))
    assert np.array_equal(idx, want)
    # More samples than rows: every row once.
    assert np.array_equal(reference_indices(plain, 900, np.random.default_rng(3)), np.arange(500))


def test_the_profile_is_built_from_the_shard_sets_rows(tmp_path: Path) -> None:
    ds = _shard_set(tmp_path)
    profile = profile_dataset(ds, samples=100, seed=0)
    again = profile_dataset(ds, samples=100, seed=0)
    assert profile.to_json() == again.to_json()  # seeded through the shard choice too
    assert profile.to_json() != profile_dataset(ds, samples=100, seed=1).to_json()
