"""A per-user cache of traced steps (`hpcml.train.memtrace`), so that every run's prediction
block can take its numbers from a trace of its own config at the cost of a file read.

A trace depends only on what the step computes: the model (its zoo name and completed
arguments, and the source code of every module class in it), the input's shape and type, the
micro-batch and accumulation, precision, optimizer, recomputation, channels-last, the loss, the
layout and number of devices traced, and the versions of torch and hpcml. The key is a
sha256 of those; the entry is the trace's JSON (no code, nothing unpickled). The folder is
`$HPCML_CACHE_DIR/plan_traces`, else `$XDG_CACHE_HOME/hpcml/plan_traces`, else
`~/.cache/hpcml/plan_traces`; an entry that cannot be read or written is traced again.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from hpcml import __version__
from hpcml.config import RunConfig
from hpcml.train.validate import Resolved

# hpcml's own code a trace runs besides the model's classes (a change to it changes traces).
_TRACE_CODE = (
    "hpcml.models.memtrace",
    "hpcml.train.memtrace",
    "hpcml.distributed.wrapping",
    "hpcml.train.schedule",
    "hpcml.train.losses",
)


def cache_dir() -> Path:
    root = os.environ.get("HPCML_CACHE_DIR")
    if root:
        return Path(root) / "plan_traces"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "hpcml" / "plan_traces"


@functools.lru_cache(maxsize=256)
def _file_digest(path: str, mtime_ns: int, size: int) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _code_digest(model: torch.nn.Module) -> str:
    """sha256 over the source files of the model's module classes (torch's own are covered by
    its version) and of hpcml's tracing code."""
    import importlib

    torch_root = str(Path(torch.__file__).parent)
    files = {importlib.import_module(name).__file__ for name in _TRACE_CODE}
    for module in model.modules():
        try:
            files.add(inspect.getsourcefile(type(module)))
        except TypeError:  # a class defined in C or interactively: nothing to hash
            continue
    digest = hashlib.sha256()
    for f in sorted(f for f in files if f and not f.startswith(torch_root)):
        st = os.stat(f)
        digest.update(f.encode() + _file_digest(f, st.st_mtime_ns, st.st_size).encode())
    return digest.hexdigest()


def trace_key(cfg: RunConfig, res: Resolved, devices: int) -> str:
    splits = res.splits
    parts = {
        "model": cfg.model.name,
        "model_args": res.model_args,
        "input": [list(splits.input_shape), splits.input_dtype, list(splits.target_shape)],
        "batch": [cfg.data.batch_size, res.grad_accum],
        "precision": cfg.precision,
        "optim": cfg.optim.model_dump(mode="json"),
        "train": [
            cfg.train.activation_checkpointing,
            cfg.train.ac_every,
            cfg.train.channels_last,
            cfg.train.loss,
        ],
        "parallel": cfg.parallel.model_dump(mode="json"),
        "finetune": cfg.finetune.method,
        "devices": devices,
        "versions": [torch.__version__, __version__],
        "code": _code_digest(res.meta_model),
    }
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def load(key: str) -> dict[str, Any] | None:
    try:
        entry = json.loads((cache_dir() / f"{key}.json").read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(entry, dict) and entry.get("key") == key and "peak_bytes" in entry
    return entry["trace"] if ok and isinstance(entry.get("trace"), dict) else None


def store(key: str, trace: dict[str, Any]) -> None:
    """Written whole or not at all (a temporary file renamed); a folder that cannot be
    written only costs the next run a trace."""
    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    except OSError:
        return
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"key": key, "peak_bytes": trace["peak_bytes"], "trace": trace}, f)
        os.replace(tmp, folder / f"{key}.json")
    except (OSError, TypeError, ValueError):
        Path(tmp).unlink(missing_ok=True)
