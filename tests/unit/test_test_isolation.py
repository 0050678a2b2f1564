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


def test_traced_steps_go_to_a_folder_of_this_session_every_worker_shares(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The per-user trace cache (hpcml.train.trace_cache) of every xdist worker is one folder
    of this session's: under ~/.cache it would outlive the session, per worker it traces each
    config once per worker."""
    import os

    from hpcml.train.trace_cache import cache_dir

    base = tmp_path_factory.getbasetemp().resolve()
    session = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    assert cache_dir().resolve() == session / "plan-traces"
