"""Checkpoint manifests and their verification, split over the ranks (issue 11, item 7).

Saving: each rank hashes (sha256) the files it wrote right after writing them, while they are
still in the page cache, and leaves `hashes-rank-R.json` beside them; rank 0 merges those into
`manifest.json` (every file with its size, sha256 and writing rank), written last. No rank
hashes another rank's files, and nothing is hashed twice.

Resuming: `verify_shared` checks each file of the manifest once, on one rank: the rank that
wrote it when the world size is unchanged (that rank reads it back: its `rank-R.pt` and its DCP
shard files), else files spread over the ranks by size. `fault.checkpoint_verify` chooses how:
`full` (sha256), `size` (sizes only) or `none` (the manifest must be there and readable). A
checkpoint verified this way is not verified again when it is loaded.

Which rank wrote a file comes from its name: `rank-R.pt` and DCP's `__R_*.distcp` shard files
are rank R's; `trainer.pt` and DCP's `.metadata` are rank 0's. A file outside these patterns
is hashed by rank 0 when it writes the manifest, so a renamed layout is still covered.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

from hpcml.distributed.runtime import Runtime, all_gather_object
from hpcml.errors import CheckpointError

MANIFEST = "manifest.json"
CORRUPT_DIR = "corrupt"
VERIFY_MODES = ("full", "size", "none")
_STEP_RE = re.compile(r"^step-(\d+)$")
_HASHES_RE = re.compile(r"^hashes-rank-(\d+)\.json$")
_OWNER_RES = (re.compile(r"^rank-(\d+)\.pt$"), re.compile(r"^__(\d+)_\d+\.distcp$"))

bytes_hashed = 0
"""Bytes this process has fed to sha256 (tests count hashing passes with it)."""
_count_lock = threading.Lock()
_verified: set[tuple[str, int]] = set()
"""(checkpoint path, manifest mtime_ns) verified by `verify_shared` in this process."""


def sha256_file(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    n = 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
            n += len(chunk)
    global bytes_hashed
    with _count_lock:
        bytes_hashed += n
    return h.hexdigest()


def fsync_tree(root: Path) -> None:
    for p in sorted(root.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(root)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def writer_of(rel: str) -> int | None:
    """The rank that wrote this checkpoint file (None: not a known per-rank or rank-0 file)."""
    name = Path(rel).name
    for pattern in _OWNER_RES:
        m = pattern.match(name)
        if m:
            return int(m.group(1))
    return 0 if name in ("trainer.pt", ".metadata") else None


def _data_files(root: Path) -> list[Path]:
    return [
        p
        for p in sorted(root.rglob("*"))
        if p.is_file()
        and p.name != MANIFEST
        and not p.name.startswith(MANIFEST)
        and not _HASHES_RE.match(p.name)
    ]


def _entry(path: Path, rank: int, mode: str) -> dict[str, Any]:
    digest = sha256_file(path) if mode != "none" else None
    return {"bytes": path.stat().st_size, "sha256": digest, "rank": rank}


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def write_own_hashes(tmp: Path, rank: int, mode: str = "full", error: str | None = None) -> None:
    """This rank's files of the checkpoint being written in `tmp`, hashed (unless `mode` is
    none), into `hashes-rank-R.json`; `error` instead tells rank 0 this rank's write failed."""
    if error is not None:
        _write_json(tmp / f"hashes-rank-{rank}.json", {"error": error})
        return
    files = {
        str(p.relative_to(tmp)): _entry(p, rank, mode)
        for p in _data_files(tmp)
        if writer_of(str(p.relative_to(tmp))) == rank
    }
    _write_json(tmp / f"hashes-rank-{rank}.json", {"files": files})


def wait_hashes(tmp: Path, world_size: int, poll_s: float = 0.01) -> None:
    """Rank 0, background saves: until every rank has left its hashes (the watchdog's
    checkpoint timeout ends a wait for a rank that never does)."""
    for r in range(world_size):
        while not (tmp / f"hashes-rank-{r}.json").exists():
            time.sleep(poll_s)


def write_manifest(root: Path, step: int, world_size: int, mode: str = "full") -> None:
    """Rank 0: merge every rank's hashes (files no rank claimed are hashed here) and write the
    manifest last."""
    files: dict[str, Any] = {}
    for r in range(world_size):
        side = root / f"hashes-rank-{r}.json"
        if not side.exists():
            continue
        part = json.loads(side.read_text())
        if "error" in part:
            raise CheckpointError(f"rank {r} could not write its part of {root}: {part['error']}")
        files.update(part["files"])
    for p in _data_files(root):
        rel = str(p.relative_to(root))
        if rel not in files:
            files[rel] = _entry(p, 0, mode)
    for side in root.glob("hashes-rank-*.json"):
        side.unlink()
    _write_json(root / MANIFEST, {"step": step, "world_size": world_size, "files": files})


def step_of(path: Path) -> int | None:
    m = _STEP_RE.match(path.name)
    return int(m.group(1)) if m else None


def read_manifest(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    manifest_path = path / MANIFEST
    if not manifest_path.exists():
        return None, f"checkpoint {path} has no {MANIFEST}, so it is incomplete"
    try:
        manifest = json.loads(manifest_path.read_text())
        if not isinstance(manifest["files"], dict):
            raise TypeError
    except (json.JSONDecodeError, KeyError, TypeError):
        return None, f"checkpoint {path} has an unreadable {MANIFEST}"
    return manifest, None


def share_of(manifest: dict[str, Any], rank: int, world_size: int) -> list[str]:
    """The files `rank` checks: those it wrote when the world size is unchanged, else a share
    balanced by bytes (largest first to the least loaded rank; the same answer on every rank)."""
    files: dict[str, Any] = manifest["files"]
    if manifest.get("world_size") == world_size:
        return [rel for rel, info in files.items() if int(info.get("rank", 0)) == rank]
    load = [0] * world_size
    mine = []
    for rel, info in sorted(files.items(), key=lambda kv: (-int(kv[1]["bytes"]), kv[0])):
        r = load.index(min(load))
        load[r] += int(info["bytes"])
        if r == rank:
            mine.append(rel)
    return mine


def verify(path: Path, deep: bool | str = True, share: tuple[int, int] | None = None) -> str | None:
    """None when the checkpoint is complete and intact, else one sentence saying what is wrong.

    `deep`: True or "full" checks sha256, False or "size" sizes only, "none" only the manifest.
    `share` (rank, world_size) checks only that rank's share of the files (see `share_of`)."""
    mode = {True: "full", False: "size"}.get(deep, deep) if isinstance(deep, bool) else deep
    manifest, problem = read_manifest(path)
    if manifest is None or mode == "none":
        return problem
    files = manifest["files"]
    names = share_of(manifest, *share) if share is not None else list(files)
    for rel in names:
        info = files[rel]
        f = path / rel
        if not f.exists():
            return f"checkpoint {path} is missing {rel}"
        size = f.stat().st_size
        if size != info["bytes"]:
            return f"checkpoint {path}: {rel} has {size} bytes, the manifest says {info['bytes']}"
        # A manifest written with fault.checkpoint_verify=none has no hashes: sizes only.
        if mode == "full" and info.get("sha256") and sha256_file(f) != info["sha256"]:
            return f"checkpoint {path}: {rel} does not match its sha256 in the manifest (corrupt)"
    return None


def _key(path: Path) -> tuple[str, int] | None:
    try:
        return (str(path.resolve()), (path / MANIFEST).stat().st_mtime_ns)
    except OSError:
        return None


def verify_shared(path: Path, rt: Runtime, mode: str = "full") -> str | None:
    """Collective: every rank checks its share of `path` once; every rank gets the same answer
    (the lowest rank's problem, or None). A checkpoint that passes is remembered, so loading it
    right after does not check it again."""
    if mode not in VERIFY_MODES:
        raise CheckpointError(
            f"fault.checkpoint_verify={mode!r} is not one of {', '.join(VERIFY_MODES)}."
        )
    mine = verify(path, mode, share=(rt.rank, rt.world_size))
    problems = [p for p in all_gather_object(rt, mine) if p is not None]
    if problems:
        return str(problems[0])
    key = _key(path)
    if key is not None:
        _verified.add(key)
    return None


def already_verified(path: Path) -> bool:
    key = _key(path)
    return key is not None and key in _verified


def list_complete(root: Path) -> list[Path]:
    """Complete-looking checkpoints (renamed into place, manifest present), newest first."""
    if not root.exists():
        return []
    found = [(step_of(p), p) for p in root.iterdir() if p.is_dir() and step_of(p) is not None]
    found = [(s, p) for s, p in found if (p / MANIFEST).exists()]
    return [p for _, p in sorted(found, key=lambda sp: sp[0] or 0, reverse=True)]


def find_latest(root: Path, warn: Any = None, deep: bool = True) -> Path | None:
    """Newest checkpoint that verifies; corrupt ones are reported through `warn` and skipped."""
    for p in list_complete(root):
        problem = verify(p, deep)
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
    root: Path,
    warn: Any = None,
    allow_fresh_start: bool = False,
    dry_run: bool = False,
    deep: bool = True,
    known_bad: dict[Path, str] | None = None,
) -> Path | None:
    """The checkpoint `--resume auto` continues from: the newest that verifies (`deep`: sha256,
    else sizes; `known_bad` were already found corrupt). Newer ones that do not are moved aside
    (see `move_aside`), each reported through `warn`. When checkpoints exist but none
    verifies, starting again from step 0 needs `allow_fresh_start`; otherwise this raises and
    changes nothing. None when there is no checkpoint at all."""
    saved = list_saved(root)
    known_bad = known_bad or {}
    bad: list[tuple[Path, str]] = []
    chosen = None
    for p in saved:
        problem = known_bad.get(p) or verify(p, deep)
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


def folder_bytes(path: Path) -> int:
    """Bytes of the files of a checkpoint folder (what a resume reads at most)."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
