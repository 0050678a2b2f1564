"""Provenance of a run: what exactly made it (config, code, packages, data, hardware).

`collect` builds the dict the training engine writes to summary.json["provenance"]; `to_tags`
turns it into MLflow tags, so a registered model version can be traced back to its inputs.
Nothing here needs MLflow or torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
import subprocess
import sys
from collections.abc import Iterable
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGES = (
    "hpcml",
    "torch",
    "numpy",
    "torchdata",
    "safetensors",
    "pydantic",
    "scikit-learn",
    "mlflow",
    "onnxruntime",
)


def config_hash(cfg_dict: dict[str, Any]) -> str:
    """sha256 of the resolved config, `tracking` left out: where a run is logged changes nothing
    about what it trains, so the same experiment tracked twice hashes the same."""
    trained = {k: v for k, v in cfg_dict.items() if k != "tracking"}
    canonical = json.dumps(trained, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def git_state(folder: Path) -> dict[str, Any] | None:
    """Commit, branch and dirty flag of the git work tree holding `folder`; None outside one.

    Dirty means tracked files differ from the commit; untracked files (new run folders) don't count.
    """

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(
                ["git", "-C", str(folder), *args],
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if not commit:
        return None
    status = git("status", "--porcelain", "--untracked-files=no")
    return {
        "root": git("rev-parse", "--show-toplevel"),
        "commit": commit,
        "branch": git("rev-parse", "--abbrev-ref", "HEAD"),
        "dirty": bool(status) if status is not None else None,
    }


def package_versions(names: Iterable[str] = PACKAGES) -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    if out.get("hpcml") is None:
        # Running from a source tree without an install: the package still knows its version.
        from hpcml import __version__

        out["hpcml"] = __version__
    torch = sys.modules.get("torch")
    if torch is not None:
        # Only when the caller already imported torch: provenance must not pay for that import.
        out["cuda"] = getattr(torch.version, "cuda", None)
        cudnn = getattr(torch.backends, "cudnn", None)
        out["cudnn"] = str(cudnn.version()) if cudnn and cudnn.is_available() else None
    return out


def hardware(device_info: dict[str, Any]) -> dict[str, Any]:
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "device": dict(device_info),
    }


def collect(
    cfg_dict: dict[str, Any],
    data_fingerprint: str,
    device_info: dict[str, Any],
    workdir: Path | None = None,
) -> dict[str, Any]:
    """Everything needed to trace a run: config hash, code version (git of the working folder
    and of hpcml's own source when that is a checkout), package versions, data, hardware."""
    workdir = (workdir or Path.cwd()).resolve()
    code = git_state(workdir)
    source = git_state(Path(__file__).resolve().parent)
    if source is not None and code is not None and source["root"] == code["root"]:
        source = None  # hpcml's own checkout is the working folder: said once is enough
    return {
        "config_hash": config_hash(cfg_dict),
        "code": {"workdir": str(workdir), "git": code, "hpcml_source_git": source},
        "packages": package_versions(),
        "data_fingerprint": data_fingerprint,
        "hardware": hardware(device_info),
        "command": list(sys.argv),
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def to_tags(provenance: dict[str, Any]) -> dict[str, str]:
    """Flat string tags for MLflow. `mlflow.source.git.commit` is MLflow's own key, so the UI
    shows the commit where it shows it for any other run."""
    tags: dict[str, str] = {}

    def put(key: str, value: Any) -> None:
        if value is not None:
            tags[key] = str(value).lower() if isinstance(value, bool) else str(value)

    put("hpcml.config_hash", provenance.get("config_hash"))
    put("hpcml.data_fingerprint", provenance.get("data_fingerprint"))
    code = provenance.get("code") or {}
    git = code.get("git") or {}
    put("mlflow.source.git.commit", git.get("commit"))
    put("mlflow.source.git.branch", git.get("branch"))
    put("hpcml.git_dirty", git.get("dirty"))
    src = code.get("hpcml_source_git") or {}
    put("hpcml.source_git_commit", src.get("commit"))
    put("hpcml.source_git_dirty", src.get("dirty"))
    for name, version in (provenance.get("packages") or {}).items():
        put(f"hpcml.version.{name}", version)
    hw = provenance.get("hardware") or {}
    put("hpcml.host", hw.get("hostname"))
    put("hpcml.cpu_count", hw.get("cpu_count"))
    device = hw.get("device") or {}
    put("hpcml.device.type", device.get("type"))
    put("hpcml.device.name", device.get("name"))
    put("hpcml.device.count", device.get("count"))
    return tags


def fingerprint_files(paths: Iterable[Path], root: Path | None = None) -> str:
    """sha256 over the names, sizes and contents of files (folders are walked in sorted order).

    Names are taken relative to `root` (or to each given path's parent), so the same data in
    another folder has the same fingerprint.
    """
    h = hashlib.sha256()
    for given in sorted(Path(p) for p in paths):
        base = root or given.parent
        files = sorted(f for f in given.rglob("*") if f.is_file()) if given.is_dir() else [given]
        for f in files:
            rel = f.relative_to(base).as_posix() if f.is_relative_to(base) else f.name
            h.update(f"{rel}\0{f.stat().st_size}\0".encode())
            with open(f, "rb") as fh:
                h.update(hashlib.file_digest(fh, "sha256").digest())
    return "sha256:" + h.hexdigest()
