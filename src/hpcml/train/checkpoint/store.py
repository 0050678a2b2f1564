"""Checkpoints on torch.distributed.checkpoint (DCP), visible only when complete.

Layout of `checkpoints/step-N/`:
  DCP files (model + optimizer, rank-independent keys, so 1 and N ranks read each other's)
  trainer.pt      shared trainer state from rank 0: step, LR scheduler, grad scaler, world size
  rank-R.pt       per-rank state: RNG states (python, numpy, torch, CUDA) and data-loader position
  manifest.json   every file with its size, sha256 and writing rank, written last

All ranks write into `.step-N.tmp/` and hash the files they wrote (hpcml.train.checkpoint.manifest);
rank 0 fsyncs, merges the hashes into the manifest and renames the folder
to `step-N` (an atomic rename), so a crash mid-write leaves only a `.tmp` folder that resume
ignores and the next save removes.

With `background=True` (train.checkpoint_async) the state is copied to host memory, DCP writes
it from a thread (torch.distributed.checkpoint.async_save, on a gloo group of its own) and rank 0
renames the folder when every rank's write is done; one background save is in flight at a time.
The writer thread runs below training's priority (hpcml.train.checkpoint.writer).
"""

from __future__ import annotations

import os
import random
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

from hpcml import crypt
from hpcml.distributed import dcp_safe
from hpcml.distributed.parallel import checkpoint_state, load_checkpoint_state, unwrap
from hpcml.distributed.pipeline import keys_of_other_stages
from hpcml.distributed.runtime import Runtime, barrier
from hpcml.distributed.sidechannel import checkpoint_group
from hpcml.errors import CheckpointError, WorkFailed
from hpcml.train.checkpoint import manifest, writer
from hpcml.train.checkpoint import phase as ckpt_phase
from hpcml.train.checkpoint.files import load_state_file, save_state_file
from hpcml.train.checkpoint.manifest import (  # re-exported: the checkpoint API in one place
    CORRUPT_DIR,
    MANIFEST,
    find_latest,
    list_complete,
    list_saved,
    move_aside,
    resume_target,
    step_of,
    verify,
)
from hpcml.train.checkpoint.phase import phase

__all__ = [
    "CORRUPT_DIR",
    "MANIFEST",
    "Loaded",
    "find_latest",
    "list_complete",
    "list_saved",
    "load",
    "load_state_file",
    "move_aside",
    "resume_target",
    "save",
    "step_of",
    "verify",
    "wait_pending",
]


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


@dataclass
class SaveTiming:
    step: int
    background: bool
    stall_s: float
    """Time the training loop was blocked by this save, waiting for the previous background
    save included."""
    total_s: float | None = None
    """Time from the start of this save's own work until the checkpoint was complete on disk
    (renamed into place); rank 0 only."""


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


def _finalize(
    root: Path, tmp: Path, final: Path, step: int, keep_last: int, world_size: int, mode: str
) -> None:
    with phase("fsync", step):
        manifest.fsync_tree(tmp)
    with phase("manifest", step):
        manifest.write_manifest(tmp, step, world_size, mode)
    with phase("rename", step):
        os.replace(tmp, final)
        ckpt_phase.point("renamed", step)
        manifest.fsync_dir(root)
    with phase("prune", step):
        prune(root, keep_last, step)


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
    mode: str,
    writer_nice: int,
    key: crypt.Key | None = None,
) -> None:
    """Rank-R files are on disk before this rank joins DCP's collectives, and rank 0's DCP
    future completes only after every rank's write: then rank 0 can finalize alone (in the
    writer's callback thread; the phases it goes through are watched like the loop's)."""
    global _pending
    upload_done = writer.async_save(state, str(tmp), checkpoint_group(rt), writer_nice, key)
    done: Future[None] = Future()

    def finish(f: Future[Any]) -> None:
        try:
            ckpt_phase.end(writing)
            try:
                f.result()
            except BaseException as exc:
                # Tell rank 0, which waits for every rank's hashes, that none will come.
                manifest.write_own_hashes(tmp, rt.rank, error=f"{type(exc).__name__}: {exc}")
                raise
            with phase("hash", step):
                manifest.write_own_hashes(tmp, rt.rank, mode)
            if rt.is_main:
                with phase("wait", step):
                    manifest.wait_hashes(tmp, rt.world_size)
                _finalize(root, tmp, final, step, keep_last, rt.world_size, mode)
                timing.total_s = time.perf_counter() - t0
            done.set_result(None)
        except BaseException as exc:  # noqa: BLE001 - handed to wait_pending()
            done.set_exception(exc)

    upload_done.add_done_callback(finish)
    with _lock:
        _pending = _Pending(final, done)


def interrupted_inside(exc: BaseException) -> bool:
    """Whether torch.distributed.checkpoint wrapped a KeyboardInterrupt into its
    CheckpointException (a BaseException with a traceback per rank, not the user's Ctrl-C)."""
    failures = getattr(exc, "failures", None)
    if not isinstance(failures, dict):
        return False
    inner = [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return any(isinstance(e, KeyboardInterrupt) for e in inner)


def layout_of(rt: Runtime) -> dict[str, int]:
    """What a rank's own state (RNG, data position) is only valid for."""
    return {"world_size": rt.world_size, "tp": rt.tp, "pp": rt.pp}


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
    verify: str = "full",
    writer_nice: int = 0,
    key: crypt.Key | None = None,
) -> Path:
    """Save step `step`; the returned path exists once the save is complete (at return, unless
    `background`: then after `wait_pending()` or the next save). Each rank hashes the files it
    wrote (`verify`: fault.checkpoint_verify; `none` records sizes only). A background save's
    writer thread runs `writer_nice` nice levels below training (hpcml.train.checkpoint.writer).

    The stall counts from the call: waiting for the previous background save is part of it;
    the time until durable counts from the start of this save's own work."""
    called = time.perf_counter()
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
        save_state_file(rank_state, tmp / f"rank-{rt.rank}.pt", key)
        if rt.is_main:
            save_state_file({**trainer_state, "step": step, **layout_of(rt)}, tmp / "trainer.pt", key)
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
                verify,
                writer_nice,
                key,
            )
            timing.stall_s = time.perf_counter() - called
            return final
        sealed = None if key is None else dcp_safe.sealed_writer(str(tmp), key)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp), storage_writer=sealed)
    except BaseException as exc:
        ckpt_phase.end(writing)
        if interrupted_inside(exc):  # a second Ctrl-C on one process, during the write
            raise KeyboardInterrupt("SIGINT during a checkpoint write") from None
        raise
    ckpt_phase.end(writing)
    with phase("hash", step):
        manifest.write_own_hashes(tmp, rt.rank, verify)
    _barrier(rt, step)
    if rt.is_main:
        _finalize(root, tmp, final, step, keep_last, rt.world_size, verify)
    _barrier(rt, step)
    timing.stall_s = time.perf_counter() - called
    timing.total_s = time.perf_counter() - t0 if rt.is_main else None
    return final


def prune(root: Path, keep_last: int, step: int = 0) -> None:
    """Delete all but the newest `keep_last` complete checkpoints. Each is first renamed to
    `.step-N.pruning` (atomic), so a crash mid-delete never leaves a half-deleted `step-N` to
    resume from; what a crash left (`.tmp`, `.pruning`) is removed here."""
    for old in list_complete(root)[keep_last:]:
        doomed = old.with_name(f".{old.name}.pruning")
        os.replace(old, doomed)
        ckpt_phase.point("pruning", step)  # a fault drill strikes here
        shutil.rmtree(doomed, ignore_errors=True)
    for stale in [*root.glob(".step-*.tmp"), *root.glob(".step-*.pruning")]:
        shutil.rmtree(stale, ignore_errors=True)


def load(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    rt: Runtime,
    cfg: Any = None,
    key: crypt.Key | None = None,
) -> Loaded:
    """Load model + optimizer in place (any world size) and return trainer and per-rank state.

    A checkpoint that does not fit ends with one sentence naming the first mismatched key and
    the config difference that likely caused it, before anything is loaded. With `cfg` (the
    RunConfig), a changed LR horizon is refused unless optim.decay_steps sets it explicitly.
    """
    wait_pending()
    with ckpt_phase.phase("read", step_of(path) or 0):  # watched like a save's phases
        return _load(path, model, optimizer, rt, cfg, key)


def _load(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    rt: Runtime,
    cfg: Any,
    key: crypt.Key | None,
) -> Loaded:
    mode = cfg.fault.checkpoint_verify if cfg is not None else "full"
    # Each file once, on one rank; skipped when the resume choice just verified it.
    problem = None if manifest.already_verified(path) else manifest.verify_shared(path, rt, mode)
    if problem is not None:
        raise CheckpointError(f"{problem}; choose another checkpoint or use --resume auto.")
    trainer = load_state_file(path / "trainer.pt", key)
    model_sd, optim_sd = checkpoint_state(model, optimizer)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    # Under parallel.pp each stage expects its own keys; the others' are not extra.
    elsewhere = keys_of_other_stages(unwrap(model), list(_flat_expected(state)))
    mismatch = first_mismatch(path, state, elsewhere, key)
    if mismatch is not None:
        raise CheckpointError(
            f"checkpoint {path} does not fit this run: {mismatch}"
            f"{likely_cause(trainer.get('config'), cfg)}; resume with the config that wrote it, "
            "or start a new --run-dir."
        )
    if cfg is not None:
        check_lr_horizon(path, trainer, cfg)
    try:
        dcp_safe.load(state, path, key)  # no code runs from the folder (crafted metadata or entries)
    except (CheckpointError, crypt.EncryptionError):
        raise
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - CheckpointException is a BaseException
        if interrupted_inside(exc):  # a second Ctrl-C on one process, not a mismatch
            raise KeyboardInterrupt("SIGINT during a checkpoint read") from None
        raise CheckpointError(
            f"checkpoint {path} does not fit this model or optimizer ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:200] if str(exc) else ''}); resume with the config "
            "that wrote it."
        ) from None
    load_checkpoint_state(model, optimizer, state["model"], state["optim"])
    rank_file = path / f"rank-{rt.rank}.pt"
    rank_state = None
    same_layout = all(trainer.get(k, 1) == v for k, v in layout_of(rt).items())
    if same_layout and rank_file.exists():
        rank_state = load_state_file(rank_file, key)
    return Loaded(path, int(trainer["step"]), trainer, rank_state)


def _flat_expected(state: dict[str, Any]) -> dict[str, tuple[int, ...] | None]:
    """DCP's flattened keys of `state` with each tensor's global shape (None: not a tensor)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(state)
    return {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in flat.items()}


def first_mismatch(
    path: Path,
    state: dict[str, Any],
    elsewhere: set[str] | frozenset[str] = frozenset(),
    seal_key: crypt.Key | None = None,
) -> str | None:
    """The first key this run expects that the checkpoint lacks or holds in another shape, or
    the first tensor the checkpoint holds that this run has no place for."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        saved = dcp_safe.read_metadata(path, seal_key).state_dict_metadata
    except (CheckpointError, crypt.EncryptionError):
        raise  # crafted or damaged metadata, or the wrong key: its own sentence
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
        if isinstance(meta, TensorStorageMetadata) and key not in expected.keys() | elsewhere:
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
