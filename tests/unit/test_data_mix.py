"""`data.mix` (issue 30 item 9): several shard sets read as one in proportion to their
weights, deterministic from (seed, epoch), and elastic like a single set: a resume on another
world size continues at the next unseen position of the same mixed order."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import TensorDataset

from hpcml.config import DataConfig, MixSource
from hpcml.data.loader import EpochLoader
from hpcml.data.shards import ShardSet
from hpcml.data.shards.convert import shard
from hpcml.data.shards.mix import MixedSet
from hpcml.data.sources import load_source
from hpcml.errors import DataError

B, SEED = 8, 21


@pytest.fixture(scope="module")
def sets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("mix")
    # 3x32x32 float32 samples, 60 KB shards of 4: A has 80 training samples, B 48.
    shard("synthetic", base / "a", shard_size="60KB", synthetic_samples=100, val_fraction=0.2)
    shard("synthetic", base / "b", shard_size="60KB", synthetic_samples=60, val_fraction=0.2)
    return base / "a", base / "b"


def mixed(sets: tuple[Path, Path], window: int | None = None) -> MixedSet:
    parts = [ShardSet(p, "train", with_ids=True, shuffle_shards=window) for p in sets]
    return MixedSet(parts, [3.0, 1.0], shuffle=True)


def test_an_epoch_draws_each_set_by_its_weight(sets: tuple[Path, Path]) -> None:
    mix = mixed(sets, window=2)
    assert len(mix) == 128 and mix.draws == [96, 32]  # 3:1 of the 128 samples of both
    order = mix.epoch_order(SEED, 0)
    assert np.array_equal(order, mix.epoch_order(SEED, 0))  # a function of (seed, epoch)
    assert not np.array_equal(order, mix.epoch_order(SEED, 1))
    from_a = Counter(int(i) for i in order if i < 80)
    from_b = Counter(int(i) for i in order if i >= 80)
    # A (80) drawn 96 times: all of it once, 16 of it twice; B (48) drawn 32 times, no repeat.
    assert set(from_a) == set(range(80)) and sorted(from_a.values()).count(2) == 16
    assert sum(from_b.values()) == 32 and max(from_b.values()) == 1
    # Each set's stream keeps its own shard-window order: B's first 32 of its epoch order.
    b_order = mix.parts[1].epoch_order(SEED + 7919 * 2, 0)
    assert [int(i) - 80 for i in order if i >= 80] == b_order[:32].tolist()
    # Read through a loader, items are the parts' own (x, y, id).
    x, y, sid = mix[85]
    assert int(sid) == int(mix.parts[1][5][2])


def tagged() -> MixedSet:
    """A mix of two in-memory sets whose inputs name the sample: 0..79 and 1000..1047."""
    a = TensorDataset(torch.arange(80), torch.zeros(80, dtype=torch.long))
    b = TensorDataset(1000 + torch.arange(48), torch.zeros(48, dtype=torch.long))
    return MixedSet([a, b], [3.0, 1.0], shuffle=True)


def tags(mix: MixedSet, indices: list[int]) -> list[int]:
    return [int(mix[i][0]) for i in indices]


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
def test_a_mix_resumes_on_another_world_size(before: int, after: int) -> None:
    cfg = DataConfig(batch_size=B)
    first = [EpochLoader(tagged(), cfg, r, before, SEED, False) for r in range(before)]
    seen = [int(t) for ld in first for _ in range(3) for t in ld.next()[0]]
    pos = first[0].position()
    assert pos == {"epoch": 0, "samples": 3 * B * before}
    second = [EpochLoader(tagged(), cfg, r, after, SEED, False) for r in range(after)]
    for ld in second:
        ld.resume_at(0, pos["samples"])
    per_rank = (128 - pos["samples"]) // (B * after)
    rest = [int(t) for ld in second for _ in range(per_rank) for t in ld.next()[0]]
    assert all(ld.epoch == 0 for ld in second)
    # Every position of the mixed order once (as multisets: a set drawn twice repeats samples):
    # the first 3*B*before before the resume, the rest after, less the new world's drop_last
    # tail; and the ranks' batches interleaved rebuild the order itself.
    mix = tagged()
    order = mix.epoch_order(SEED, 0).tolist()
    tail = (128 - pos["samples"]) % (B * after)
    assert Counter(seen) == Counter(tags(mix, order[: pos["samples"]]))
    assert Counter(rest) == Counter(tags(mix, order[pos["samples"] : 128 - tail]))
    if after == 1:
        assert rest == tags(mix, order[pos["samples"] : 128 - tail])


def test_mix_configs_are_checked(sets: tuple[Path, Path], tmp_path: Path) -> None:
    a, b = sets
    both = [MixSource(path=str(a), weight=1), MixSource(path=str(b), weight=1)]
    got = load_source(DataConfig(source="shards", mix=both))
    assert len(got.train) == 128 and len(got.val) == 20 + 12
    with pytest.raises(DataError, match="data.mix and data.path are both set"):
        load_source(DataConfig(source="shards", path=str(a), mix=both))
    table = tmp_path / "t.parquet"
    pq.write_table(pa.table({"f": np.arange(40.0), "label": np.arange(40) % 2}), table)
    shard(str(table), tmp_path / "t")
    other = [MixSource(path=str(a), weight=1), MixSource(path=str(tmp_path / "t"), weight=1)]
    with pytest.raises(DataError, match="holds samples of shape"):
        load_source(DataConfig(source="shards", mix=other))
