"""Checkpoints on torch.distributed.checkpoint (DCP), visible only when complete.

Layout of `checkpoints/step-N/`:
  DCP files (model + optimizer, rank-independent keys, so 1 and N ranks read each other's)
  trainer.pt      shared trainer state from rank 0: step, LR scheduler, grad scaler, world size
  rank-R.pt       per-rank state: RNG states (python, numpy, torch, CUDA) and data-loader position
  manifest.json   every file with its size and sha256, written last

All ranks write into `.step-N.tmp/`; rank 0 fsyncs, writes the manifest and renames the folder
to `step-N` (an atomic rename), so a crash mid-write leaves only a `.tmp` folder that resume
ignores and the next save removes.

With `background=True` (train.checkpoint_async) the state is copied to host memory, DCP writes
it from a thread (torch.distributed.checkpoint.async_save, on a gloo group of its own) and rank 0
renames the folder when every rank's write is done; one background save is in flight at a time.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import re
import shutil
import statistics
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from hpcml.distributed.parallel import checkpoint_state, load_checkpoint_state
from hpcml.distributed.runtime import Runtime, barrier, broadcast_object
from hpcml.distributed.sidechannel import checkpoint_group
from hpcml.errors import CheckpointError, WorkFailed
from hpcml.train import ckpt_phase
from hpcml.train.ckpt_phase import phase

MANIFEST = "manifest.json"
_STEP_RE = re.compile(r"^step-(\d+)$")


@dataclass
class Loaded:
    path: Path
    step: int
    trainer: dict[str, Any]
    rank_state: dict[str, Any] | None
    """None when the checkpoint was written by a different world size (no per-rank match)."""


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_tree(root: Path) -> None:
    for p in sorted(root.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(root)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_manifest(root: Path, step: int) -> None:
    files = {
        str(p.relative_to(root)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }
    tmp = root / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"step": step, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(root / MANIFEST)


def step_of(path: Path) -> int | None:
    m = _STEP_RE.match(path.name)
    return int(m.group(1)) if m else None


def verify(path: Path, deep: bool = True) -> str | None:
    """None when the checkpoint is complete and intact, else one sentence saying what is wrong."""
    manifest_path = path / MANIFEST
    if not manifest_path.exists():
        return f"checkpoint {path} has no {MANIFEST}, so it is incomplete"
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return f"checkpoint {path} has an unreadable {MANIFEST}"
    for rel, info in files.items():
        f = path / rel
        if not f.exists():
            return f"checkpoint {path} is missing {rel}"
        if f.stat().st_size != info["bytes"]:
            return f"checkpoint {path}: {rel} has {f.stat().st_size} bytes, the manifest says {info['bytes']}"
        if deep and _sha256(f) != info["sha256"]:
            return f"checkpoint {path}: {rel} does not match its sha256 in the manifest (corrupt)"
    return None


def list_complete(root: Path) -> list[Path]:
    """Complete-looking checkpoints (renamed into place, manifest present), newest first."""
    if not root.exists():
        return []
    found = [(step_of(p), p) for p in root.iterdir() if p.is_dir() and step_of(p) is not None]
    found = [(s, p) for s, p in found if (p / MANIFEST).exists()]
    return [p for _, p in sorted(found, key=lambda sp: sp[0] or 0, reverse=True)]


def find_latest(root: Path, warn: Any = None) -> Path | None:
    """Newest checkpoint that verifies; corrupt ones are reported through `warn` and skipped."""
    for p in list_complete(root):
        problem = verify(p)
        if problem is None:
            return p
        if warn is not None:
            warn(f"{problem}; using the previous complete checkpoint.")
    return None


def list_saved(root: Path) -> list[Path]:
    """Every `step-N` folder (renamed into place, so complete when written), newest first."""
    if not root.exists():
        return []
    found = [(step_of(p) or 0, p) for p in root.iterdir() if p.is_dir() and step_of(p) is not None]
    return [p for _, p in sorted(found, key=lambda sp: sp[0], reverse=True)]


CORRUPT_DIR = "corrupt"


def move_aside(path: Path) -> Path:
    """Move a checkpoint that failed verification to `checkpoints/corrupt/` (never deleted: a
    person may still recover it; out of the way of resume, retention and a new save of that
    step)."""
    target_dir = path.parent / CORRUPT_DIR
    target_dir.mkdir(exist_ok=True)
    target = target_dir / path.name
    n = 1
    while target.exists():
        target = target_dir / f"{path.name}.{n}"
        n += 1
    os.replace(path, target)
    return target


def resume_target(
    root: Path, warn: Any = None, allow_fresh_start: bool = False, dry_run: bool = False
) -> Path | None:
    """The checkpoint `--resume auto` continues from: the newest that verifies. Newer ones that
    do not are moved aside (see `move_aside`), each reported through `warn`. When checkpoints
    exist but none verifies, starting again from step 0 needs `allow_fresh_start`; otherwise
    this raises and changes nothing. None when there is no checkpoint at all."""
    saved = list_saved(root)
    bad: list[tuple[Path, str]] = []
    chosen = None
    for p in saved:
        problem = verify(p)
        if problem is None:
            chosen = p
            break
        bad.append((p, problem))
    if chosen is None and bad and not allow_fresh_start:
        raise CheckpointError(
            f"none of the {len(bad)} checkpoint(s) in {root} is complete ({bad[0][1]}); nothing "
            "was changed. Pass --allow-fresh-start to move them to "
            f"{root / CORRUPT_DIR} and start from step 0, or --resume a checkpoint path."
        )
    then = "using the previous complete checkpoint" if chosen else "starting from step 0"
    for p, problem in bad:
        where = "" if dry_run else f"; moved it to {move_aside(p)}"
        if warn is not None:
            warn(f"{problem}{where}; {then}.")
    return chosen


@dataclass
class SaveTiming:
    step: int
    background: bool
    stall_s: float
    """Time the training loop was blocked by this save."""
    total_s: float | None = None
    """Time until the checkpoint was complete on disk (renamed into place); rank 0 only."""


timings: list[SaveTiming] = []
"""This process's saves, oldest first (the benchmark and the run summary read them)."""


@dataclass
class _Pending:
    path: Path
    done: Future[None]


_pending: _Pending | None = None
_lock = threading.Lock()


def wait_pending() -> Path | None:
    """Block until the background save in flight (if any) is complete; re-raise its failure."""
    global _pending
    with _lock:
        pending, _pending = _pending, None
    if pending is None:
        return None
    try:
        pending.done.result()
    except Exception as exc:
        raise WorkFailed(
            f"background checkpoint {pending.path} failed ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:200] if str(exc) else ''}); check free space and "
            "permissions of the run folder."
        ) from exc
    return pending.path


def timing_summary(items: list[SaveTiming] | None = None) -> dict[str, Any]:
    items = timings if items is None else items
    if not items:
        return {"count": 0}
    stalls = [t.stall_s for t in items]
    totals = [t.total_s for t in items if t.total_s is not None]
    return {
        "count": len(items),
        "background": items[-1].background,
        "stall_s_median": statistics.median(stalls),
        "stall_s_max": max(stalls),
        "total_s_median": statistics.median(totals) if totals else None,
    }


def _finalize(root: Path, tmp: Path, final: Path, step: int, keep_last: int) -> None:
    with phase("fsync", step):
        _fsync_tree(tmp)
    with phase("manifest", step):
        _write_manifest(tmp, step)
    with phase("rename", step):
        os.replace(tmp, final)
        _fsync_dir(root)
    with phase("prune", step):
        prune(root, keep_last)


def _barrier(rt: Runtime, step: int) -> None:
    with phase("wait", step):
        barrier(rt)


def _save_in_background(
    root: Path,
    tmp: Path,
    final: Path,
    step: int,
    keep_last: int,
    rt: Runtime,
    timing: SaveTiming,
    t0: float,
    writing: int,
    state: dict[str, Any],
) -> None:
    """Rank-R files are on disk before this rank joins DCP's collectives, and rank 0's DCP
    future completes only after every rank's write: then rank 0 can finalize alone (in the
    writer's callback thread; the phases it goes through are watched like the loop's)."""
    global _pending
    upload = dcp.async_save(state, checkpoint_id=str(tmp), process_group=checkpoint_group(rt))
    # Newer torch returns an AsyncSaveResponse (staging + upload futures), older a Future.
    upload_done: Future[Any] = getattr(upload, "upload_completion", upload)  # type: ignore[arg-type]
    done: Future[None] = Future()

    def finish(f: Future[Any]) -> None:
        try:
            ckpt_phase.end(writing)
            f.result()
            if rt.is_main:
                _finalize(root, tmp, final, step, keep_last)
                timing.total_s = time.perf_counter() - t0
            done.set_result(None)
        except BaseException as exc:  # noqa: BLE001 - handed to wait_pending()
            done.set_exception(exc)

    upload_done.add_done_callback(finish)
    with _lock:
        _pending = _Pending(final, done)
    timing.stall_s = time.perf_counter() - t0


def save(
    root: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    rank_state: dict[str, Any],
    rt: Runtime,
    keep_last: int,
    background: bool = False,
) -> Path:
    """Save step `step`; the returned path exists once the save is complete (at return, unless
    `background`: then after `wait_pending()` or the next save)."""
    wait_pending()
    t0 = time.perf_counter()
    final = root / f"step-{step}"
    tmp = root / f".step-{step}.tmp"
    if rt.is_main:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        if final.exists():  # re-saving the same step (e.g. after a rollback): replace it whole
            shutil.rmtree(final)
        tmp.mkdir(parents=True)
    _barrier(rt, step)
    writing = ckpt_phase.begin("write", step)
    timing = SaveTiming(step, background, 0.0)
    timings.append(timing)
    try:
        model_sd, optim_sd = checkpoint_state(model, optimizer)
        torch.save(rank_state, tmp / f"rank-{rt.rank}.pt")
        if rt.is_main:
            torch.save(
                {**trainer_state, "step": step, "world_size": rt.world_size, "tp": rt.tp},
                tmp / "trainer.pt",
            )
        if background:
            _save_in_background(
                root,
                tmp,
                final,
                step,
                keep_last,
                rt,
                timing,
                t0,
                writing,
                {"model": model_sd, "optim": optim_sd},
            )
            return final
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    except BaseException:
        ckpt_phase.end(writing)
        raise
    ckpt_phase.end(writing)
    _barrier(rt, step)
    if rt.is_main:
        _finalize(root, tmp, final, step, keep_last)
    _barrier(rt, step)
    timing.stall_s = time.perf_counter() - t0
    timing.total_s = timing.stall_s if rt.is_main else None
    return final


def load_state_file(path: Path) -> dict[str, Any]:
    """A trainer or per-rank state file, read without running code from it.

    `weights_only=True` unpickles tensors and plain containers only; numpy's RNG state is a
    uint32 array, the one foreign type these files hold, so its three globals are allowed.
    A file that names anything else (a crafted pickle) is refused in one sentence.
    """
    core = getattr(np, "_core", None) or np.core
    allowed = [core.multiarray._reconstruct, np.ndarray, np.dtype, np.dtypes.UInt32DType]
    try:
        with torch.serialization.safe_globals(allowed):
            state = torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{path} holds objects other than tensors and plain data "
            f"({str(exc).split('Unsupported global: ')[-1].splitlines()[0][:120]}), which hpcml "
            "does not unpickle; resume from a checkpoint hpcml wrote."
        ) from None
    if not isinstance(state, dict):
        raise CheckpointError(
            f"{path} does not hold a state mapping; resume from another checkpoint."
        )
    return state


def prune(root: Path, keep_last: int) -> None:
    for old in list_complete(root)[keep_last:]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".step-*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)


def load(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    rt: Runtime,
    cfg: Any = None,
) -> Loaded:
    """Load model + optimizer in place (any world size) and return trainer and per-rank state.

    A checkpoint that does not fit ends with one sentence naming the first mismatched key and
    the config difference that likely caused it, before anything is loaded. With `cfg` (the
    RunConfig), a changed LR horizon is refused unless optim.decay_steps sets it explicitly.
    """
    wait_pending()
    problem = verify(path) if rt.is_main else None
    problem = broadcast_object(rt, problem)
    if problem is not None:
        raise CheckpointError(f"{problem}; choose another checkpoint or use --resume auto.")
    trainer = load_state_file(path / "trainer.pt")
    model_sd, optim_sd = checkpoint_state(model, optimizer)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    mismatch = first_mismatch(path, state)
    if mismatch is not None:
        raise CheckpointError(
            f"checkpoint {path} does not fit this run: {mismatch}"
            f"{likely_cause(trainer.get('config'), cfg)}; resume with the config that wrote it, "
            "or start a new --run-dir."
        )
    if cfg is not None:
        check_lr_horizon(path, trainer, cfg)
    try:
        dcp.load(state, checkpoint_id=str(path))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - CheckpointException is a BaseException
        raise CheckpointError(
            f"checkpoint {path} does not fit this model or optimizer ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:200] if str(exc) else ''}); resume with the config "
            "that wrote it."
        ) from None
    load_checkpoint_state(model, optimizer, state["model"], state["optim"])
    rank_file = path / f"rank-{rt.rank}.pt"
    rank_state = None
    same_layout = trainer.get("world_size") == rt.world_size and trainer.get("tp", 1) == rt.tp
    if same_layout and rank_file.exists():
        rank_state = load_state_file(rank_file)
    return Loaded(path, int(trainer["step"]), trainer, rank_state)


def _flat_expected(state: dict[str, Any]) -> dict[str, tuple[int, ...] | None]:
    """DCP's flattened keys of `state` with each tensor's global shape (None: not a tensor)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(state)
    return {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in flat.items()}


def first_mismatch(path: Path, state: dict[str, Any]) -> str | None:
    """The first key this run expects that the checkpoint lacks or holds in another shape, or
    the first tensor the checkpoint holds that this run has no place for."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception:  # noqa: BLE001 - let dcp.load report an unreadable checkpoint
        return None
    expected = _flat_expected(state)
    for key, shape in expected.items():
        if key.startswith("optim.param_groups"):
            continue  # hyper-parameters: the config decides them
        meta = saved.get(key)
        if meta is None:
            return f"it has no '{key}', which this run needs"
        sized = shape is not None and isinstance(meta, TensorStorageMetadata)
        if sized and tuple(meta.size) != shape:  # type: ignore[union-attr]
            return f"'{key}' has shape {list(meta.size)} there and {list(shape or ())} here"  # type: ignore[union-attr]
    for key, meta in saved.items():
        if isinstance(meta, TensorStorageMetadata) and key not in expected:
            return f"it holds '{key}', which this run has no place for"
    return None


_CAUSE_KEYS = (
    "model.name",
    "model.args",
    "optim.name",
    "train.loss",
    "data.source",
    "data.seq_len",
    "data.vocab_size",
)


def likely_cause(saved_cfg: Any, cfg: Any) -> str:
    """'; it was written with model.name=mlp, this run has model.name=simple_cnn' or ''."""
    if not isinstance(saved_cfg, dict) or cfg is None:
        return ""
    now = cfg.model_dump(mode="json")
    for dotted in _CAUSE_KEYS:
        section, key = dotted.split(".")
        before = saved_cfg.get(section, {}).get(key)
        after = now.get(section, {}).get(key)
        if before != after:
            return f"; it was written with {dotted}={before}, this run has {dotted}={after}"
    return ""


def check_lr_horizon(path: Path, trainer: dict[str, Any], cfg: Any) -> None:
    saved = trainer.get("lr_horizon")
    if saved is None or cfg.optim.schedule == "constant":
        return  # written before horizons were stored, or a schedule without one
    explicit = cfg.optim.decay_steps
    now = explicit or cfg.train.max_steps
    if explicit is None and int(saved) != now:
        raise CheckpointError(
            f"checkpoint {path} was trained with an LR schedule over {saved} steps and this run "
            f"has train.max_steps={cfg.train.max_steps}, which would silently move the "
            f"schedule; set optim.decay_steps={saved} to keep it (or optim.decay_steps={now} to "
            "stretch it) and resume again."
        )
