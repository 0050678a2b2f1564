"""`data.verify` (issue 30: every rank re-hashed the whole local set at every start): the
hashing is split over the ranks, each hashing its share once (2 gloo processes under
torchrun), and a file's digest is remembered between runs while the file is unchanged, yet a
file changed in place, even with its modification time set back, is hashed again."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from tests.conftest import ROOT, hpcml_env

from hpcml.config import DataConfig
from hpcml.data.shards import read_manifest, verify
from hpcml.data.shards.convert import shard
from hpcml.data.shards.hash_cache import FILE
from hpcml.data.sources import load_source
from hpcml.errors import DataError

WORKER = Path(__file__).with_name("verify_split_worker.py")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("verify") / "s"
    # 100 samples of 3x32x32 float32: 60 KB shards hold 4: 20 train + 5 val shards.
    shard("synthetic", out, shard_size="60KB", synthetic_samples=100, val_fraction=0.2)
    return out


def hashed_files(cache_dir: Path) -> set[str]:
    with sqlite3.connect(cache_dir / FILE) as db:
        return {Path(p).name for (p,) in db.execute("SELECT path FROM files")}


def test_each_rank_hashes_its_share_once(root: Path, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(WORKER), str(root), str(tmp_path)],
        cwd=ROOT, env=hpcml_env(), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    shards = [
        s["file"] for sp in ("train", "val") for s in read_manifest(root)["splits"][sp]["shards"]
    ]
    zero, one = hashed_files(tmp_path / "rank-0"), hashed_files(tmp_path / "rank-1")
    assert zero == set(shards[0::2]) and one == set(shards[1::2])  # disjoint halves, all of it


def test_a_digest_is_remembered_while_the_file_is_unchanged(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = tmp_path / "s"
    work.mkdir()
    for f in root.iterdir():
        (work / f.name).write_bytes(f.read_bytes())
    monkeypatch.setenv("HPCML_CACHE_DIR", str(tmp_path / "cache"))
    manifest = read_manifest(work)
    verify(work, manifest, shared=True)  # hashes and remembers every file
    victim = work / "train-00003.arrow"
    # The cache is what a second start reads: a remembered digest that is wrong for the file
    # (written into the table here) fails the check without the file being hashed again ...
    with sqlite3.connect(tmp_path / "cache" / FILE) as db:
        db.execute("UPDATE files SET sha256 = ? WHERE path = ?", ("0" * 64, str(victim)))
    with pytest.raises(DataError, match="train-00003.arrow does not match the sha256"):
        verify(work, manifest, shared=True)
    # ... and a file changed in any way is hashed again: a same-size edit with its
    # modification time set back has a new change time.
    st = victim.stat()
    victim.write_bytes(victim.read_bytes())  # the same bytes: only the times change
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    verify(work, manifest, shared=True)  # hashed again: correct
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    victim.write_bytes(bytes(raw))
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(DataError, match="train-00003.arrow does not match the sha256"):
        verify(work, manifest, shared=True)
    # data.verify: size skips the hashing (the same-size edit passes), none every check.
    load_source(DataConfig(source="shards", path=str(work), verify="size"))
    (work / "val-00000.arrow").write_bytes(b"short")
    with pytest.raises(DataError, match="val-00000.arrow does not match"):
        load_source(DataConfig(source="shards", path=str(work), verify="size"))
    load_source(DataConfig(source="shards", path=str(work), verify="none"))
