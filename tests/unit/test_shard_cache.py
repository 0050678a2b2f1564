"""The disk cache of remote shards on its own (`hpcml.data.shards.cache`): which file goes when
the limit is passed, what is refused, what a dead writer leaves, and that it never deletes a
file it did not write. Real files in tmp_path."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from hpcml.data.shards.cache import MARKER, SUBFOLDER, TMP_PREFIX, DiskCache
from hpcml.errors import DataError


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
    assert sorted(p.name for p in cache.files()) == sorted([f"{sa}-a.arrow", f"{sc}-c.arrow"])
    assert not pb.exists()
    assert cache.total_bytes() <= 2500


def test_a_wrong_size_is_a_miss_and_a_shard_over_the_limit_is_not_kept(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path, limit_bytes=1500)
    a, sa = blob(1000, 1)
    p = cache.put("a.arrow", sa, a)
    assert p is not None
    assert cache.lookup("a.arrow", sa, 999) is None and not p.exists()
    big, sbig = blob(2000, 9)
    assert cache.put("big.arrow", sbig, big) is None
    assert cache.files() == [] and not any(p.name.endswith(".arrow") for p in cache.folder.iterdir())


def test_a_dead_writers_temporary_file_is_removed_a_live_ones_kept(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path, limit_bytes=10_000)
    dead = cache.folder / f"{TMP_PREFIX}{'d' * 64}-x.arrow.abc.tmp"
    live = cache.folder / f"{TMP_PREFIX}{'e' * 64}-x.arrow.abc.tmp"
    dead.write_bytes(b"x" * 10)
    live.write_bytes(b"x" * 10)
    age(dead, 7200)
    a, sa = blob(100, 1)
    cache.put("a.arrow", sa, a)
    assert not dead.exists() and live.exists()


def test_a_manifest_cannot_name_a_file_outside_the_cache(tmp_path: Path) -> None:
    """A manifest's sha256 is part of the cached file's name; a hostile one ("../victim") made
    `lookup` find a file outside the cache, see it was not intact and delete it."""
    victim = tmp_path / "victim-x.arrow"
    victim.write_bytes(b"keep me")
    cache = DiskCache(tmp_path / "cache", limit_bytes=10_000)
    with pytest.raises(DataError, match="is not 64 hex digits"):
        cache.lookup("x.arrow", "../victim", 7)
    assert victim.read_bytes() == b"keep me"


def test_eviction_deletes_only_files_the_cache_wrote(tmp_path: Path) -> None:
    """`data.cache_dir` pointed at a folder of the user's own files (issue 30: three results
    files were deleted by a 6-step run). Foreign files of every age, beside the cache and even
    inside its subfolder under a cached file's name pattern, survive a cache far over its limit."""
    rng_ages = [0, 60, 3600, 86400, 10 * 365 * 86400]  # from now to ten years old
    foreign: dict[Path, bytes] = {}
    inside = tmp_path / SUBFOLDER
    for n, seconds in enumerate(rng_ages):
        p = tmp_path / f"results_{n}.npz"
        p.write_bytes(bytes([n]) * 3000)
        age(p, seconds)
        foreign[p] = p.read_bytes()
    sub = tmp_path / "nested"
    sub.mkdir()
    (sub / "notes.txt").write_bytes(b"mine")
    foreign[sub / "notes.txt"] = b"mine"
    cache = DiskCache(tmp_path, limit_bytes=2500)
    assert cache.folder == inside and (inside / MARKER).is_file()
    for n, seconds in enumerate(rng_ages):  # in the cache's own folder, not written by it
        data, digest = blob(900, 100 + n)
        p = inside / f"{digest}-old{n}.arrow"
        p.write_bytes(data)
        age(p, seconds)
        foreign[p] = data
        q = inside / f"{TMP_PREFIX}stray{n}"
        q.write_bytes(b"x")
        age(q, seconds)
        foreign[q] = b"x"
    written = []
    for n in range(8):  # 8 x 1000 bytes through a 2500-byte cache: most must go
        data, digest = blob(1000, n)
        p = cache.put(f"s{n}.arrow", digest, data)
        assert p is not None
        written.append(p)
    assert cache.total_bytes() <= 2500
    assert [p for p in written if p.exists()] == written[-2:]  # the cache's own old files went
    for p, data in foreign.items():
        assert p.read_bytes() == data, p
    cache.evict()
    assert all(p.read_bytes() == data for p, data in foreign.items())


def test_a_folder_of_the_cache_s_name_that_hpcml_did_not_make_is_refused(tmp_path: Path) -> None:
    (tmp_path / SUBFOLDER).mkdir()
    (tmp_path / SUBFOLDER / "mine.txt").write_bytes(b"keep")
    with pytest.raises(DataError, match=f"holds a {SUBFOLDER} that hpcml did not make"):
        DiskCache(tmp_path, limit_bytes=10)
    assert (tmp_path / SUBFOLDER / "mine.txt").read_bytes() == b"keep"


def test_processes_sharing_one_cache_dir_keep_one_index(tmp_path: Path) -> None:
    """Two caches on one folder (as two ranks of a host): each sees the other's files, and
    eviction by one deletes the other's least recently used file, so the limit holds for both."""
    one, two = DiskCache(tmp_path, 2500), DiskCache(tmp_path, 2500)
    (a, sa), (b, sb), (c, sc) = blob(1000, 1), blob(1000, 2), blob(1000, 3)
    pa_ = one.put("a.arrow", sa, a)
    two.put("b.arrow", sb, b)
    assert two.lookup("a.arrow", sa, 1000) == pa_  # a used after b: b is the oldest now
    one.put("c.arrow", sc, c)
    assert sorted(p.name for p in two.files()) == sorted([f"{sa}-a.arrow", f"{sc}-c.arrow"])
