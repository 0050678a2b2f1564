"""Run-record I/O: the JSONL step log, summary.json and atomic JSON writes.

A run folder is the contract between training, planning (`plan check`), tracking and serving,
so its files are written here and nowhere else.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

RUN_LOG = "run.jsonl"
SUMMARY = "summary.json"
CONFIG = "config.yaml"
EXCLUDE_NODES = "exclude_nodes"
"""Node names, comma-separated on one line (SLURM's ExcNodeList form), that a requeued job must
leave out: persistent stragglers (hpcml.train.fault.straggler), read by `hpcml launch slurm`'s script."""


def write_bytes_atomic(path: Path, data: Any, tmp_prefix: str | None = None) -> None:
    """Write `data` (bytes-like) so that a reader sees the old file or the new one, never half
    of one: a temporary file beside it (named `tmp_prefix`..., by default `.NAME.`...),
    flushed to disk, then renamed over it. The temporary file is removed on any failure."""
    path.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{path.name}." if tmp_prefix is None else tmp_prefix
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=prefix, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON so that a reader sees the old file or the new one, never half of one."""
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def write_text_atomic(path: Path, text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))


class RunLog:
    """Append-only JSONL log, one object per line, flushed per write so a crash loses at most a line."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(path, "a", buffering=1)  # noqa: SIM115 - closed in close()

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record, default=float) + "\n")

    def write_many(self, records: list[dict[str, Any]]) -> None:
        self._f.write("".join(json.dumps(r, default=float) + "\n" for r in records))

    def close(self) -> None:
        self._f.close()


def read_run_log(path: Path) -> list[dict[str, Any]]:
    """Read a run.jsonl; a torn last line (crash mid-write) is skipped, not an error."""
    out: list[dict[str, Any]] = []
    if not path.exists():
        return out
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def iter_step_records(path: Path) -> Iterator[dict[str, Any]]:
    for r in read_run_log(path):
        if r.get("kind", "step") == "step":
            yield r


def truncate_run_log_after(path: Path, step: int) -> None:
    """On resume, drop records past the checkpoint's step so the log reads as one clean run."""
    if not path.exists():
        return
    kept = [r for r in read_run_log(path) if int(r.get("step", 0)) <= step]
    write_text_atomic(path, "".join(json.dumps(r, default=float) + "\n" for r in kept))


def add_excluded_nodes(run_dir: Path, nodes: list[str]) -> list[str]:
    """Add `nodes` to the run folder's `EXCLUDE_NODES` (kept in order, no repeats); the list."""
    path = run_dir / EXCLUDE_NODES
    have = path.read_text().strip().split(",") if path.exists() else []
    merged = [n for n in have if n] + [n for n in nodes if n not in have]
    write_text_atomic(path, ",".join(merged) + "\n")
    return merged


def read_summary(run_dir: Path) -> dict[str, Any]:
    with open(run_dir / SUMMARY) as f:
        data: dict[str, Any] = json.load(f)
    return data
