"""A tamper-evident audit log: JSON lines, each carrying the hash of the one before it.

Every admin action of a server, every registry alias move (promotion, rollback) and every
traffic change is appended as one line:

    {"seq": 7, "time": "2026-11-27T20:41:03.512Z", "actor": "ci-bot", "action": "traffic",
     "target": "digits", "reason": "...", "details": {...}, "prev": "<hash of line 6>",
     "hash": "<sha256 of this line without its hash>"}

The first line's `prev` is 64 zeros. Editing a line breaks its own hash; deleting, inserting or
moving one breaks the next line's `prev` (and `seq`); `verify` names the first broken line.
Cutting lines off the end leaves a shorter chain that verifies: keep a copy of the last hash
elsewhere (`hpcml audit verify --json` prints it) to detect that too.

Appends hold an exclusive `flock` on the file while they read the last line and write theirs,
so processes appending at once (a server, a CLI promotion) keep one chain; each line is
written with a single `write` and `fsync`ed before `append` returns.
"""

from __future__ import annotations

import fcntl
import getpass
import hashlib
import json
import os
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from hpcml.errors import ConfigError

GENESIS = "0" * 64
FIELDS = ("seq", "time", "actor", "action", "target", "reason", "details", "prev", "hash")


def os_user() -> str:
    """The name of the user running this process (who, when no token names the caller)."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return f"uid-{os.getuid()}"


def _digest(record: dict[str, Any]) -> str:
    body = {k: v for k, v in record.items() if k != "hash"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def _last_line(fd: int) -> bytes:
    """The last complete line of the open file (b"" when empty), read from its end."""
    end = os.lseek(fd, 0, os.SEEK_END)
    block, tail = 4096, b""
    pos = end
    while pos > 0:
        step = min(block, pos)
        pos -= step
        tail = os.pread(fd, step, pos) + tail
        lines = tail.rstrip(b"\n").rsplit(b"\n", 1)
        if len(lines) == 2 or pos == 0:
            return lines[-1]
    return b""


class AuditLog:
    """Appends records to one file (made on the first record); see the module docstring."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def check(self, where: str) -> AuditLog:
        """Refuse now, in one sentence, a path no record could be appended to."""
        if self.path.exists() and not self.path.is_file():
            raise ConfigError(f"{where} {str(self.path)!r} is not a file; pass a file path.")
        parent = self.path.parent
        if not parent.is_dir() or not os.access(parent, os.W_OK):
            raise ConfigError(
                f"{where} {str(self.path)!r} cannot be written (its folder is missing or not "
                "writable); pass a path in a writable folder."
            )
        if self.path.exists() and not os.access(self.path, os.W_OK):
            raise ConfigError(f"{where} {str(self.path)!r} is not writable; pass another path.")
        return self

    def append(
        self, actor: str, action: str, target: str, reason: str = "", **details: Any
    ) -> dict[str, Any]:
        """Append one record (chained to the last) and fsync it; returns the record."""
        created = not self.path.exists()
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o640)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            last = _last_line(fd)
            prev, seq = GENESIS, 1
            if last:
                try:
                    before = json.loads(last)
                    prev, seq = str(before["hash"]), int(before["seq"]) + 1
                except (ValueError, KeyError, TypeError):
                    # A damaged last line: chain to its bytes, so `verify` still names it.
                    prev = hashlib.sha256(last).hexdigest()
            record: dict[str, Any] = {
                "seq": seq,
                "time": datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
                "actor": actor,
                "action": action,
                "target": target,
                "reason": reason,
                "details": details,
                "prev": prev,
            }
            record["hash"] = _digest(record)
            line = json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
            end = os.lseek(fd, 0, os.SEEK_END)
            # A line cut short by a crash stays a line of its own (which `verify` names).
            start = b"\n" if end and os.pread(fd, 1, end - 1) != b"\n" else b""
            os.write(fd, start + line.encode() + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)  # releases the lock
        if created:  # the new name itself must survive a crash
            dir_fd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        return record


@dataclass(frozen=True)
class Verdict:
    records: int
    last_hash: str
    broken_line: int | None = None
    problem: str = ""

    @property
    def intact(self) -> bool:
        return self.broken_line is None


def verify(path: str | Path) -> Verdict:
    """Check the whole chain; the first broken line and what is wrong with it, if any."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"audit log {str(path)!r} is not a file; pass the log's path.")
    prev, count = GENESIS, 0
    try:
        with file.open("rb") as f:
            for number, raw in enumerate(f, start=1):
                problem = _check_line(raw, number, prev)
                if problem:
                    return Verdict(count, prev, number, problem)
                prev, count = json.loads(raw)["hash"], count + 1
    except OSError as exc:
        raise ConfigError(f"audit log {str(path)!r} cannot be read ({exc.strerror}).") from None
    return Verdict(count, prev)


def _check_line(raw: bytes, number: int, prev: str) -> str:
    """Why line `number` breaks the chain, or ""."""
    try:
        record = json.loads(raw)
    except ValueError:
        return "it is not a JSON record (edited, or cut short by a crash)"
    if not isinstance(record, dict) or sorted(record) != sorted(FIELDS):
        return "it does not hold exactly the fields of an audit record (edited)"
    if record["hash"] != _digest(record):
        return "its content does not match its hash (the record was edited)"
    if record["prev"] != prev or record["seq"] != number:
        return (
            "it does not follow the record before it (a record was deleted, inserted or moved "
            "before it)"
        )
    return ""


@dataclass(frozen=True)
class Attribution:
    """Who moves something in the registry, and why: MLflow tags and an audit record."""

    who: str
    why: str = ""
    log: AuditLog | None = None

    @classmethod
    def local(cls, why: str = "", audit_log: str | Path | None = None) -> Attribution:
        """The OS user of this process, with an optional reason and audit log (checked)."""
        log = AuditLog(audit_log).check("--audit-log") if audit_log else None
        return cls(os_user(), why, log)
