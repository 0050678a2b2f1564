"""What `hpcml train` checks before any worker starts, and running the engine in this process."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hpcml.config import RunConfig
from hpcml.data.sources import check_source
from hpcml.models.zoo import get_spec
from hpcml.train import rundir


def preflight(cfg: RunConfig) -> None:
    """Everything a user can get wrong that is cheap to check: model name, data location."""
    get_spec(cfg.model.name)
    check_source(cfg.data)


def prepare_for_workers(
    config: Path,
    run_dir: Path | None,
    resume: str | None,
    overwrite: bool,
    allow_fresh_start: bool = False,  # [fault] issue 11
) -> Path:
    """Check (and on --overwrite clear) the run folder in one process before workers start."""
    chosen = run_dir or rundir.default_run_dir(config)
    rundir.resolve(
        chosen,
        resume,
        overwrite,
        warn=lambda m: print(f"warning: {m}", file=sys.stderr),  # [fault] corrupt ones moved
        allow_fresh_start=allow_fresh_start,
    )
    return chosen


def run_here(
    cfg: RunConfig,
    config: Path,
    run_dir: Path | None,
    resume: str | None,
    overwrite: bool,
    quiet: bool,
    allow_fresh_start: bool = False,  # [fault] issue 11
) -> dict[str, Any]:
    from hpcml.train.engine import run

    return run(
        cfg,
        run_dir=run_dir,
        resume=resume,
        overwrite=overwrite,
        quiet=quiet,
        config_path=config,
        allow_fresh_start=allow_fresh_start,
    )
