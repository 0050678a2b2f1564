"""sha256 of local shard files, remembered between runs while a file is unchanged.

Why: `data.verify: full` hashes every shard of a local set before training; at terabyte scale
that is hours at every start and restart. The digest of a file is kept with what `stat` says
of it (size, modification and change times in ns, inode): a file written again, truncated,
touched or replaced has another change time (which a user cannot set back), so it is hashed
again; an unchanged one is not. The table is SQLite (several ranks of a host share it) in
`$HPCML_CACHE_DIR`, else `$XDG_CACHE_HOME/hpcml`, else `~/.cache/hpcml`; where it cannot be
written, files are simply hashed each time.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from pathlib import Path

from hpcml.data.arrow_shard import sha256_of as sha256_of  # re-exported: its callers import it here

FILE = "shard-sha256.sqlite"


def cache_path() -> Path:
    base = os.environ.get("HPCML_CACHE_DIR")
    if base:
        return Path(base).expanduser() / FILE
    xdg = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(xdg).expanduser() / "hpcml" / FILE


class HashCache:
    """`sha256(path)`: from the table when the file is as it was when hashed, else hashed now
    (and remembered). `hashed` counts the files hashed by this object (tests, reports)."""

    def __init__(self, location: Path | None = None) -> None:
        self.location = location or cache_path()
        self.hashed = 0

    def _db(self) -> sqlite3.Connection | None:
        try:
            self.location.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.location, timeout=60)
            db.execute(
                "CREATE TABLE IF NOT EXISTS files (path TEXT PRIMARY KEY, size INTEGER, "
                "mtime_ns INTEGER, ctime_ns INTEGER, inode INTEGER, sha256 TEXT)"
            )
            return db
        except (OSError, sqlite3.Error):
            return None  # an unwritable cache folder: hash every time

    def sha256(self, path: Path) -> str:
        real = os.path.realpath(path)
        st = os.stat(real)
        stamp = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
        db = self._db()
        if db is None:
            self.hashed += 1
            return sha256_of(Path(real))
        with contextlib.closing(db):
            row = db.execute(
                "SELECT size, mtime_ns, ctime_ns, inode, sha256 FROM files WHERE path = ?",
                (real,),
            ).fetchone()
            if row is not None and tuple(row[:4]) == stamp:
                return str(row[4])
            digest = sha256_of(Path(real))
            self.hashed += 1
            with contextlib.suppress(sqlite3.Error), db:
                db.execute(
                    "INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?, ?)",
                    (real, *stamp, digest),
                )
            return digest
