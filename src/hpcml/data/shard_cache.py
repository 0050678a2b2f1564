"""A local disk cache of remote shards (`data.cache_dir`, `data.cache_limit_gb`).

Why: a remote shard is otherwise downloaded again every time a reading process needs it after
evicting it from its `data.shard_cache` slots, every epoch and every run. With a cache, a shard
is downloaded once per host, checked against the manifest's sha256, and then memory-mapped from
local disk like a shard of a local folder (the page cache holds it, not the process's heap).

- A cached file is named `<sha256>-<file>`: a shard set whose shard changed names another file,
  so a stale copy is never read for it.
- Written atomically: a temporary file in the cache folder, fsync, then `os.replace`, so
  several ranks and loader workers on one host may fill the same folder; the worst case is two
  downloads of one shard, never a half-written file under the final name.
- Before each use the file's size is checked against the manifest, and once per process (per
  file inode) its sha256, hashed from the file 4 MiB at a time; a file that fails either is
  deleted and fetched again.
- Above `data.cache_limit_gb` the least recently used files (by modification time, refreshed on
  each use) are deleted after each write; a shard larger than the whole limit is not cached.
  Deleting a file another process has mapped is safe on POSIX: its mapping stays valid.
  Temporary files older than an hour (a writer that died) are deleted then too.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import time
from pathlib import Path
from typing import Any

from hpcml.errors import DataError
from hpcml.records import write_bytes_atomic

_HEX64 = re.compile(r"[0-9a-f]{64}")

TMP_PREFIX = ".partial-"
STALE_TMP_S = 3600
"""A temporary file older than this was left by a writer that died; it is deleted."""
_verified: set[tuple[str, int]] = set()
"""(path, inode) of cached files this process has hashed or written (a replaced file is a new
inode; a truncated one fails the size check)."""


class DiskCache:
    """Remote shards kept on local disk, keyed by their sha256."""

    def __init__(self, folder: str | Path, limit_bytes: int) -> None:
        self.folder = Path(folder).expanduser()
        self.limit_bytes = int(limit_bytes)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DataError(
                f"data.cache_dir {self.folder} cannot be created ({exc.strerror or exc}); "
                "point it at a writable local folder or leave it unset."
            ) from None

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
        """The cached file of shard `name`, or None when absent or not intact (then deleted)."""
        p = self.path(name, sha256)
        try:
            st = p.stat()
        except FileNotFoundError:
            return None
        key = (str(p), st.st_ino)
        if st.st_size != size or (key not in _verified and _sha256(p) != sha256):
            self.discard(p)
            return None
        _verified.add(key)
        with contextlib.suppress(OSError):  # another process may have evicted it just now
            os.utime(p)  # most recently used
        return p

    def put(self, name: str, sha256: str, data: Any) -> Path | None:
        """Write `data` (bytes-like, already checked against `sha256`) as shard `name`'s file;
        None when it is larger than the whole cache."""
        view = memoryview(data)
        if view.nbytes > self.limit_bytes:
            return None
        final = self.path(name, sha256)
        try:
            write_bytes_atomic(final, view, tmp_prefix=TMP_PREFIX)
        except OSError as exc:
            raise DataError(
                f"shard {name} cannot be written to data.cache_dir {self.folder} "
                f"({exc.strerror or exc}); free space there, or leave data.cache_dir unset."
            ) from None
        _verified.add((str(final), final.stat().st_ino))
        self.evict(keep=final)
        return final

    def discard(self, p: Path) -> None:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()

    def evict(self, keep: Path | None = None) -> None:
        """Delete least recently used files until the cached bytes fit the limit."""
        files = []
        now = time.time()
        for entry in os.scandir(self.folder):
            if entry.name.startswith(TMP_PREFIX):
                with contextlib.suppress(FileNotFoundError):
                    if now - entry.stat().st_mtime > STALE_TMP_S:
                        self.discard(Path(entry.path))
                continue
            if not entry.is_file():
                continue
            with contextlib.suppress(FileNotFoundError):
                st = entry.stat()
                files.append((st.st_mtime_ns, entry.name, st.st_size))
        total = sum(f[2] for f in files)
        for _, fname, size in sorted(files):
            if total <= self.limit_bytes:
                break
            if keep is not None and fname == keep.name:
                continue
            self.discard(self.folder / fname)
            total -= size

    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.folder.iterdir() if p.is_file())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()
