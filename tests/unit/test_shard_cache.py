"""The disk cache of remote shards on its own (`hpcml.data.shard_cache`): which file goes when
the limit is passed, what is refused, what a dead writer leaves. Real files in tmp_path."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from hpcml.data.shard_cache import TMP_PREFIX, DiskCache


def blob(n: int, fill: int) -> tuple[bytes, str]:
    data = bytes([fill]) * n
    return data, hashlib.sha256(data).hexdigest()


def age(p: Path, seconds_ago: float) -> None:
    t = time.time() - seconds_ago
    os.utime(p, (t, t))


def test_the_least_recently_used_file_goes_first(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path, limit_bytes=2500)
    (a, sa), (b, sb), (c, sc) = blob(1000, 1), blob(1000, 2), blob(1000, 3)
    pa_, pb = cache.put("a.arrow", sa, a), cache.put("b.arrow", sb, b)
    assert pa_ is not None and pb is not None
    age(pa_, 200)  # a written first, b later: without a use, a would go first
    age(pb, 100)
    assert cache.lookup("a.arrow", sa, 1000) == pa_  # a use makes a the most recent
    cache.put("c.arrow", sc, c)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"{sa}-a.arrow", f"{sc}-c.arrow"])
    assert cache.total_bytes() <= 2500


def test_a_wrong_size_is_a_miss_and_a_shard_over_the_limit_is_not_kept(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path, limit_bytes=1500)
    a, sa = blob(1000, 1)
    p = cache.put("a.arrow", sa, a)
    assert p is not None
    assert cache.lookup("a.arrow", sa, 999) is None and not p.exists()
    big, sbig = blob(2000, 9)
    assert cache.put("big.arrow", sbig, big) is None
    assert list(tmp_path.iterdir()) == []


def test_a_dead_writers_temporary_file_is_removed_a_live_ones_kept(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path, limit_bytes=10_000)
    dead, live = tmp_path / f"{TMP_PREFIX}dead", tmp_path / f"{TMP_PREFIX}live"
    dead.write_bytes(b"x" * 10)
    live.write_bytes(b"x" * 10)
    age(dead, 7200)
    a, sa = blob(100, 1)
    cache.put("a.arrow", sa, a)
    assert not dead.exists() and live.exists()


def test_a_manifest_cannot_name_a_file_outside_the_cache(tmp_path: Path) -> None:
    """A manifest's sha256 is part of the cached file's name; a hostile one ("../victim") made
    `lookup` find a file outside the cache, see it was not intact and delete it."""
    import pytest

    from hpcml.errors import DataError

    victim = tmp_path / "victim-x.arrow"
    victim.write_bytes(b"keep me")
    cache = DiskCache(tmp_path / "cache", limit_bytes=10_000)
    with pytest.raises(DataError, match="is not 64 hex digits"):
        cache.lookup("x.arrow", "../victim", 7)
    assert victim.read_bytes() == b"keep me"
