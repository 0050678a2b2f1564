"""What `hpcml train` checks before any worker starts, and running the Trainer in this process."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hpcml.config import RunConfig
from hpcml.data.sources import check_source
from hpcml.models.zoo import get_spec
from hpcml.train import rundir


def preflight(cfg: RunConfig, world_size: int | None = None) -> None:
    """Cheap checks (model name, data location, the metrics endpoints' TLS files); with
    `world_size`, the whole resolved config as the workers will see it (data sizes, the model
    built on meta, tp/heads/batch)."""
    get_spec(cfg.model.name)
    check_source(cfg.data)
    if cfg.observe.tls is not None:
        from hpcml.observe.tls import server_context

        server_context(cfg.observe.tls, "observe.tls")
    if world_size is not None:
        from hpcml.train.validate import resolve

        resolve(cfg, world_size)


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
    from hpcml.train.trainer import run

    return run(
        cfg,
        run_dir=run_dir,
        resume=resume,
        overwrite=overwrite,
        quiet=quiet,
        config_path=config,
        allow_fresh_start=allow_fresh_start,
    )
