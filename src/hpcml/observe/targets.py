"""Prometheus `file_sd` target files: one JSON file per endpoint, written atomically (Prometheus
re-reads a file when it changes and must never see half of one), living exactly as long as the
process that serves the endpoint.

The process removes its file on every exit it sees (finish, preemption, Ctrl-C, failure). A
process killed with SIGKILL cannot: its file names its owner (host, pid and the pid's start
time, in labels that start with `__`, which Prometheus drops after relabelling), and
`prune_dead` removes the files of owners on this host that are gone; every exporter start and
`hpcml observe up` call it on the folders they write or watch.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

OWNER_HOST = "__hpcml_host"
OWNER_PID = "__hpcml_pid"
OWNER_STARTED = "__hpcml_started"
# Process start times are read from /proc in clock ticks; the same process reads the same value
# to well within this.
SAME_START_S = 1.0


def _start_time(pid: int) -> float | None:
    """The start time of process `pid`, or None when there is none (psutil)."""
    import psutil

    try:
        return float(psutil.Process(pid).create_time())
    except psutil.NoSuchProcess:
        return None
    except psutil.AccessDenied:  # someone else's process: alive
        return -1.0


def owner_labels() -> dict[str, str]:
    started = _start_time(os.getpid())
    return {
        OWNER_HOST: socket.gethostname(),
        OWNER_PID: str(os.getpid()),
        OWNER_STARTED: f"{started:.3f}",
    }


def write_target(
    path: Path,
    address: str,
    port: int,
    labels: dict[str, str],
    metrics_path: str | None = None,
) -> Path:
    """`metrics_path`: the path Prometheus scrapes (default /metrics); an endpoint that serves
    only its own path answers 404 to a scrape meant for another process on a reused port."""
    host = f"[{address}]" if ":" in address else address  # an IPv6 literal in host:port
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    extra = {"__metrics_path__": metrics_path} if metrics_path else {}
    entry = {"targets": [f"{host}:{port}"], "labels": {**labels, **extra, **owner_labels()}}
    tmp.write_text(json.dumps([entry]))
    os.replace(tmp, path)
    return path


def _owner_gone(entries: Any, here: str) -> bool:
    """True when the file names an owner on this host that no longer runs."""
    if not isinstance(entries, list) or not entries or not isinstance(entries[0], dict):
        return False
    labels = entries[0].get("labels") or {}
    if labels.get(OWNER_HOST) != here:
        return False  # another machine's process, or a file hpcml did not write
    try:
        pid, started = int(labels[OWNER_PID]), float(labels[OWNER_STARTED])
    except (KeyError, TypeError, ValueError):
        return False
    now = _start_time(pid)
    if now is None:
        return True
    return now >= 0 and abs(now - started) > SAME_START_S  # the pid was reused


def prune_dead(folder: Path) -> list[Path]:
    """Remove the target files in `folder` whose owner on this host is gone; returns them."""
    here = socket.gethostname()
    removed = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            entries = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # unreadable or half-written by another tool: not ours to judge
        if _owner_gone(entries, here):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed
