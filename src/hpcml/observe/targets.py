"""Prometheus `file_sd` target files: one JSON file per endpoint, written atomically (Prometheus
re-reads a file when it changes and must never see half of one) and removed when the endpoint
ends cleanly. An endpoint that dies leaves its file, so `up == 0` says it died."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_target(path: Path, address: str, port: int, labels: dict[str, str]) -> Path:
    host = f"[{address}]" if ":" in address else address  # an IPv6 literal in host:port
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps([{"targets": [f"{host}:{port}"], "labels": labels}]))
    os.replace(tmp, path)
    return path
