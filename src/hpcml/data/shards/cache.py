"""A local disk cache of remote shards (`data.cache_dir`, `data.cache_limit_gb`).

Why: a remote shard is otherwise downloaded again every time a reading process needs it after
evicting it from its `data.shard_cache` slots, every epoch and every run. With a cache, a shard
is downloaded once per host, checked against the manifest's sha256, and then memory-mapped from
local disk like a shard of a local folder (the page cache holds it, not the process's heap).

- The cache owns one subfolder of `data.cache_dir`, `hpcml-shard-cache/`, made with a marker
  file in it (created under a temporary name and renamed into place, so the folder never exists
  without its marker). A folder of that name without the marker was not made by hpcml and is
  refused; everything else in `data.cache_dir` is never read, written or deleted.
- An index (SQLite, `index.sqlite` in that subfolder; SQLite's file locks serialise the
  processes of a host) lists every file the cache wrote, its size and when it was last used.
  Eviction deletes only files the index lists; a file the cache did not write is never
  deleted, wherever it is and however old.
- A cached file is named `<sha256>-<file>`: a shard set whose shard changed names another file,
  so a stale copy is never read for it.
- Written atomically: a temporary file in the subfolder, fsync, then `os.replace`, so several
  ranks and loader workers on one host may fill the same folder; the worst case is two
  downloads of one shard, never a half-written file under the final name.
- Before each use the file's size is checked against the manifest, and once per process (per
  file inode) its sha256, hashed from the file 4 MiB at a time; a file that fails either is
  deleted and fetched again.
- Above `data.cache_limit_gb` the least recently used indexed files are deleted after each
  write; a shard larger than the whole limit is not cached. Deleting a file another process
  has mapped is safe on POSIX: its mapping stays valid. The cache's own temporary files older
  than an hour (a writer that died) are deleted then too.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import sqlite3
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hpcml.errors import DataError
from hpcml.records import write_bytes_atomic

_HEX64 = re.compile(r"[0-9a-f]{64}")

SUBFOLDER = "hpcml-shard-cache"
"""The folder the cache owns inside data.cache_dir."""
MARKER = "HPCML_SHARD_CACHE"
MARKER_TEXT = (
    "This folder is hpcml's disk cache of remote shards (data.cache_dir). Files listed in\n"
    "index.sqlite are deleted when the cache is over data.cache_limit_gb; delete the whole\n"
    "folder to empty the cache.\n"
)
INDEX = "index.sqlite"
TMP_PREFIX = ".partial-"
_TMP = re.compile(re.escape(TMP_PREFIX) + r"[0-9a-f]{64}-.*\.tmp")
"""The cache's own temporary files: `.partial-<sha256>-<file>...tmp`."""
STALE_TMP_S = 3600
"""A temporary file older than this was left by a writer that died; it is deleted."""
LOCK_TIMEOUT_S = 60.0
"""How long a process waits for another's index write (each holds it for a few statements)."""
_verified: set[tuple[str, int]] = set()
"""(path, inode) of cached files this process has hashed or written (a replaced file is a new
inode; a truncated one fails the size check)."""


class DiskCache:
    """Remote shards kept on local disk, keyed by their sha256, in a folder the cache owns."""

    def __init__(self, cache_dir: str | Path, limit_bytes: int) -> None:
        self.root = Path(cache_dir).expanduser()
        self.folder = self.root / SUBFOLDER
        self.limit_bytes = int(limit_bytes)
        try:
            self._own()
            with self._index() as db:
                db.execute(
                    "CREATE TABLE IF NOT EXISTS files "
                    "(name TEXT PRIMARY KEY, bytes INTEGER NOT NULL, used_ns INTEGER NOT NULL)"
                )
        except (OSError, sqlite3.Error) as exc:
            reason = getattr(exc, "strerror", None) or exc
            raise DataError(
                f"data.cache_dir {self.root} cannot be used ({reason}); point it at a writable "
                "local folder or leave it unset."
            ) from None

    def _own(self) -> None:
        """Make the owned subfolder with its marker, or check that an existing one has it."""
        self.root.mkdir(parents=True, exist_ok=True)
        if not self.folder.exists():
            staging = Path(tempfile.mkdtemp(dir=self.root, prefix=f".{SUBFOLDER}-"))
            (staging / MARKER).write_text(MARKER_TEXT)
            try:
                staging.rename(self.folder)
            except OSError:  # another process made it first: use theirs
                (staging / MARKER).unlink()
                staging.rmdir()
        if not (self.folder / MARKER).is_file():
            raise DataError(
                f"data.cache_dir {self.root} holds a {SUBFOLDER} that hpcml did not make (no "
                f"{MARKER} file in it); move it away or choose another data.cache_dir."
            )

    @contextlib.contextmanager
    def _index(self) -> Iterator[sqlite3.Connection]:
        # A connection per use: loader workers are forked from a process that may hold one,
        # and a SQLite connection must not cross a fork.
        db = sqlite3.connect(self.folder / INDEX, timeout=LOCK_TIMEOUT_S, isolation_level=None)
        try:
            db.execute("BEGIN IMMEDIATE")
            yield db
            db.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                db.execute("ROLLBACK")
            raise
        finally:
            db.close()

    def path(self, name: str, sha256: str) -> Path:
        # Both come from a manifest someone else may have written: only a hex digest and a
        # base name go into the path, so no manifest can name (and so delete) a file elsewhere.
        if not _HEX64.fullmatch(sha256):
            raise DataError(
                f"the manifest gives shard {name!r} the sha256 {sha256[:80]!r}, which is not 64 "
                "hex digits; write the shard set again with `hpcml data shard`."
            )
        return self.folder / f"{sha256}-{Path(name).name}"

    def lookup(self, name: str, sha256: str, size: int) -> Path | None:
        """The cached file of shard `name`, or None when absent or not intact (then deleted).
        Only files in the index count: anything else is not the cache's."""
        p = self.path(name, sha256)
        with self._index() as db:
            listed = db.execute("SELECT 1 FROM files WHERE name = ?", (p.name,)).fetchone()
        if listed is None:
            return None
        try:
            st = p.stat()
        except FileNotFoundError:
            self.discard(p)
            return None
        key = (str(p), st.st_ino)
        # Hashed outside the index's lock: a shard takes a while, and other processes wait.
        if st.st_size != size or (key not in _verified and _sha256(p) != sha256):
            self.discard(p)
            return None
        _verified.add(key)
        with self._index() as db:
            db.execute("UPDATE files SET used_ns = ? WHERE name = ?", (time.time_ns(), p.name))
        return p

    def put(self, name: str, sha256: str, data: Any) -> Path | None:
        """Write `data` (bytes-like, already checked against `sha256`) as shard `name`'s file;
        None when it is larger than the whole cache."""
        view = memoryview(data)
        if view.nbytes > self.limit_bytes:
            return None
        final = self.path(name, sha256)
        try:
            write_bytes_atomic(final, view, tmp_prefix=f"{TMP_PREFIX}{final.name}.")
        except OSError as exc:
            raise DataError(
                f"shard {name} cannot be written to data.cache_dir {self.root} "
                f"({exc.strerror or exc}); free space there, or leave data.cache_dir unset."
            ) from None
        _verified.add((str(final), final.stat().st_ino))
        with self._index() as db:
            db.execute(
                "INSERT OR REPLACE INTO files (name, bytes, used_ns) VALUES (?, ?, ?)",
                (final.name, view.nbytes, time.time_ns()),
            )
            self._evict(db, keep=final.name)
        return final

    def discard(self, p: Path) -> None:
        """Delete cached file `p` (a path `lookup` or `put` returned) and its index entry."""
        with self._index() as db:
            self._drop(db, p.name)

    def _drop(self, db: sqlite3.Connection, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.folder / name).unlink()
        db.execute("DELETE FROM files WHERE name = ?", (name,))

    def evict(self) -> None:
        """Delete least recently used indexed files until the cached bytes fit the limit."""
        with self._index() as db:
            self._evict(db, keep=None)

    def _evict(self, db: sqlite3.Connection, keep: str | None) -> None:
        rows = db.execute("SELECT name, bytes FROM files ORDER BY used_ns, name").fetchall()
        total = sum(size for _, size in rows)
        for fname, size in rows:
            if total <= self.limit_bytes:
                break
            if fname == keep:
                continue
            self._drop(db, fname)
            total -= size
        now = time.time()
        for entry in os.scandir(self.folder):
            if _TMP.fullmatch(entry.name):
                with contextlib.suppress(FileNotFoundError):
                    if now - entry.stat().st_mtime > STALE_TMP_S:
                        os.unlink(entry.path)

    def total_bytes(self) -> int:
        with self._index() as db:
            (total,) = db.execute("SELECT COALESCE(SUM(bytes), 0) FROM files").fetchone()
        return int(total)

    def files(self) -> list[Path]:
        """The cached files, as the index lists them."""
        with self._index() as db:
            names = [n for (n,) in db.execute("SELECT name FROM files ORDER BY name")]
        return [self.folder / n for n in names]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()
