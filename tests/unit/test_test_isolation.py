"""The suite writes nothing outside its temporary folders."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcml.data.shards.hash_cache import HashCache, cache_path


def test_the_hash_cache_lives_in_the_sessions_temporary_folder(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """Before, every test that verified a local shard set wrote ~/.cache/hpcml."""
    base = tmp_path_factory.getbasetemp().resolve()
    assert base in cache_path().resolve().parents
    shard = tmp_path / "s.bin"
    shard.write_bytes(b"x" * 10)
    cache = HashCache()
    cache.sha256(shard)
    assert cache.location.is_file() and base in cache.location.resolve().parents
