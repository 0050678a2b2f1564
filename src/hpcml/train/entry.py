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


def check_encryption(cfg: RunConfig, run_dir: Path | None, resume: str | None) -> None:
    """Before any worker: with `encryption.enabled`, a key that cannot be had (or one kept in
    the run folder); when resuming, a checkpoint sealed with another key than the one given.
    Each is one sentence, exit 2, and nothing is changed."""
    from hpcml import crypt
    from hpcml.train.checkpoint import manifest

    key = crypt.run_key(cfg.encryption.enabled, cfg.encryption.key_file, run_dir)
    if resume is None:
        return
    if resume == "auto":
        saved = manifest.list_saved(run_dir / "checkpoints") if run_dir is not None else []
        target = saved[0] if saved else None
    else:
        target = Path(resume)
    state = target / "trainer.pt" if target is not None else None
    if state is None or not state.is_file() or not crypt.file_is_sealed(state):
        return
    key = key or crypt.key_from_env(required_for=f"checkpoint {target}")
    assert key is not None
    with open(state, "rb") as f:
        crypt.check_key(f.read(crypt.HEADER_BYTES), key, str(state))


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
