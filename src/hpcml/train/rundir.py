"""Run-folder rules: what may be written where, and which checkpoint a resume starts from.

A folder that holds a finished or unfinished run is never overwritten silently: the user says
`--resume` (continue) or `--overwrite` (start again).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from hpcml.distributed.runtime import Runtime, broadcast_object
from hpcml.errors import CheckpointError, HpcmlError, RunDirError
from hpcml.records import RUN_LOG, SUMMARY
from hpcml.train.checkpoint import manifest as ckpt_manifest
from hpcml.train.checkpoint import store as ckpt


def default_run_dir(config_path: Path | None) -> Path:
    stem = config_path.stem if config_path is not None else "run"
    return Path("runs") / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def _status(run_dir: Path) -> str | None:
    path = run_dir / SUMMARY
    if not path.exists():
        return None
    try:
        return str(json.loads(path.read_text()).get("status", "finished"))
    except (json.JSONDecodeError, OSError):
        return "unknown"


def holds_run(run_dir: Path) -> bool:
    return any((run_dir / name).exists() for name in (SUMMARY, RUN_LOG, "checkpoints"))


def resolve(
    run_dir: Path,
    resume: str | None,
    overwrite: bool,
    dry_run: bool = False,
    warn: object = None,
    allow_fresh_start: bool = False,
    known_bad: dict[Path, str] | None = None,
) -> Path | None:
    """Check the folder against the request; return the checkpoint to resume from (or None).

    With `dry_run` nothing is changed (the launcher checks before starting workers). With
    `--resume auto`, checkpoints that fail verification are moved aside, and when none is left
    the run starts from step 0 only with `allow_fresh_start` (see checkpoint.resume_target).
    Checkpoints are checked by size here (no hashing on one rank): `resolve_shared` checks
    the contents, split over the ranks; `known_bad` are those it found corrupt.
    """
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"--run-dir {run_dir} is a file, not a folder; choose another path.")
    if resume is not None and overwrite:
        raise RunDirError("--resume and --overwrite contradict each other; pass one of them.")
    if overwrite:
        if not dry_run and run_dir.exists():
            for name in (SUMMARY, RUN_LOG, "checkpoints", "export", "config.yaml", "tracking.json"):
                target = run_dir / name
                if target.is_dir():
                    shutil.rmtree(target)
                elif target.exists():
                    target.unlink()
        return None
    if resume is None:
        if holds_run(run_dir):
            status = _status(run_dir)
            what = "a finished run" if status == "finished" else "an unfinished run"
            raise RunDirError(
                f"run folder {run_dir} already holds {what}; pass --resume auto to continue it, "
                "--overwrite to start again, or choose another --run-dir."
            )
        return None
    if resume == "auto":
        return ckpt.resume_target(
            run_dir / "checkpoints", warn, allow_fresh_start, dry_run, False, known_bad
        )
    path = Path(resume)
    if not path.exists():
        raise CheckpointError(
            f"--resume {path} does not exist; pass a checkpoints/step-N folder or 'auto'."
        )
    problem = (known_bad or {}).get(path) or ckpt.verify(path, deep=False)
    if problem is not None:
        raise CheckpointError(f"{problem}; pass another checkpoint or --resume auto.")
    return path


def _on_main(rt: Runtime, fn: Any) -> Any:
    """Run `fn` on rank 0; every rank returns its result or raises its error."""
    answer: tuple[Any, ...] = ("ok", None)
    if rt.is_main:
        try:
            answer = ("ok", fn())
        except HpcmlError as exc:
            answer = ("error", type(exc).__name__, exc.message)
    answer = broadcast_object(rt, answer)
    if answer[0] == "error":
        import hpcml.errors as errors

        raise getattr(errors, answer[1], HpcmlError)(answer[2])
    return answer[1]


def resolve_shared(
    rt: Runtime,
    run_dir: Path,
    resume: str | None,
    overwrite: bool,
    warn: object = None,
    allow_fresh_start: bool = False,
    mode: str = "full",
) -> Path | None:
    """`resolve` on every rank at once (a collective): rank 0 picks a candidate by sizes,
    all ranks check its contents (each file once, on one rank; fault.checkpoint_verify), and a
    corrupt one is passed over. Nothing is moved or deleted until the choice is final, so a
    refusal (no complete checkpoint, no --allow-fresh-start) leaves the folder as it was."""
    known_bad: dict[Path, str] = {}
    while True:
        found = _on_main(
            rt,
            lambda: resolve(
                run_dir, resume, overwrite, True, None, allow_fresh_start, dict(known_bad)
            ),
        )
        if found is None:
            break
        problem = ckpt_manifest.verify_shared(Path(found), rt, mode)
        if problem is None:
            break
        known_bad[Path(found)] = problem
    return _on_main(
        rt, lambda: resolve(run_dir, resume, overwrite, False, warn, allow_fresh_start, known_bad)
    )


def finished_summary(
    run_dir: Path, checkpoint: Path | None, max_steps: int
) -> dict[str, Any] | None:
    """The summary of a run that finished at `max_steps` and whose resume target is that last
    step: a resume has nothing to train (and must not rewrite what the run wrote), or None."""
    if checkpoint is None or (ckpt.step_of(checkpoint) or 0) < max_steps:
        return None
    try:
        summary = json.loads((run_dir / SUMMARY).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return summary if isinstance(summary, dict) and summary.get("status") == "finished" else None


def finished_line(run_dir: Path, checkpoint: Path | None, cfg: Any) -> str:
    return (
        f"run folder {run_dir} has finished: its checkpoint {checkpoint} is at "
        f"train.max_steps={cfg.train.max_steps}; nothing was trained or changed. Raise "
        "train.max_steps to train further."
    )


def prepare_shared(
    rt: Runtime,
    chosen: Path,
    resume: str | None,
    overwrite: bool,
    warn: Any,
    allow_fresh_start: bool,
    mode: str,
) -> tuple[Path, Path | None]:
    """Rank 0 checks the run folder; every rank gets the same answer or the same error.
    The checkpoint to resume from is verified by all ranks together (`resolve_shared`)."""
    # A restarted elastic group resumes from the newest checkpoint, whatever was asked.
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        resume, overwrite = "auto", False
    chosen = Path(broadcast_object(rt, str(chosen)))  # rank 0's timestamped default
    found = resolve_shared(rt, chosen, resume, overwrite, warn, allow_fresh_start, mode)
    if resume == "auto" and found is None:
        warn(
            f"no complete checkpoint in {chosen / 'checkpoints'}; starting from step 0.", prefix=""
        )
    return chosen, found
