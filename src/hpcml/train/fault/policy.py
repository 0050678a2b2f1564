"""Fault-tolerance decisions made outside the training loop (launchers, the CLI): refusing
restarts without checkpoints, reading how workers ended, and checkpoint-interval advice.
Split from hpcml.train.fault.guard; that module re-exports these names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hpcml.config import RunConfig
from hpcml.errors import ConfigError
from hpcml.train.checkpoint import store as ckpt


def require_checkpoints_for_restarts(cfg: RunConfig, max_restarts: int) -> None:
    """A restart resumes from the newest checkpoint: with none until the end, it would train
    from step 0 again. Refuse that with a sentence (`hpcml launch slurm --mtbf` picks one)."""
    if max_restarts <= 0 or cfg.train.checkpoint_every or cfg.train.checkpoint_every_s:
        return
    raise ConfigError(
        f"--max-restarts {max_restarts} restarts training from its newest checkpoint, but "
        "train.checkpoint_every is 0 and train.checkpoint_every_s is null (a checkpoint only at "
        "the end): a restart would start again from step 0. Set train.checkpoint_every=N or "
        "train.checkpoint_every_s=S (`hpcml launch checkpoint-interval --mtbf ...` suggests one)."
    )


def worker_outcome(run_dir: Path, since: float) -> tuple[str | None, Path | None]:
    """How workers started at `since` ended, from the summary.json they wrote (torchrun's own
    exit code does not say): its status, and for a preemption the checkpoint saved for it, only
    when that checkpoint is complete (renamed into place, every file of its manifest there)."""
    path = run_dir / "summary.json"
    try:
        if path.stat().st_mtime < since:
            return None, None
        summary = json.loads(path.read_text())
        status = str(summary["status"])
    except (OSError, ValueError, KeyError, TypeError):
        return None, None
    saved = summary.get("checkpoint")
    if status != "preempted" or not saved:
        return status, None
    saved_path = Path(saved)
    return status, saved_path if ckpt.verify(saved_path, deep=False) is None else None


# --- checkpoint interval -------------------------------------------------------------------
# The formulas live in the planner (hpcml.plan.cost, pure functions); here they are applied to a
# measured checkpoint cost and step time.


def checkpoint_advice(
    checkpoint_s: float,
    mtbf_s: float,
    restart_s: float = 0.0,
    step_time_s: float | None = None,
) -> dict[str, Any]:
    """Optimal interval and what failures cost at it: hpcml.plan.cost.checkpoint_plan (Daly
    2006, failures as a Poisson process), the same function `plan cost spot` uses."""
    from hpcml.plan.cost import checkpoint_plan  # only the advice verb needs it

    plan = checkpoint_plan(checkpoint_s, mtbf_s, restart_s)
    interval = plan.daly_interval_s
    out: dict[str, Any] = {
        "checkpoint_s": checkpoint_s,
        "mtbf_s": mtbf_s,
        "restart_s": restart_s,
        "young_interval_s": plan.young_interval_s,
        "daly_interval_s": interval,
        "expected_lost_work_per_failure_s": plan.lost_work_per_failure_s,
        "expected_overhead_fraction": plan.overhead_fraction,
        "expected_goodput": plan.goodput,
        "step_time_s": step_time_s,
        "checkpoint_every_steps": None,
    }
    if step_time_s:
        out["checkpoint_every_steps"] = max(1, round(interval / step_time_s))
    return out


# --- checkpoint timeout ----------------------------------------------------------------------

CKPT_TIMEOUT_FLOOR_S = 120.0
"""Any checkpoint phase may take this long (metadata round trips, a busy filesystem)."""
CKPT_TIMEOUT_SLACK = 20.0
"""A phase that runs this many times longer than its bytes take at the measured bandwidth is
a hung filesystem, not a slow one."""
CKPT_ASSUMED_BYTES_PER_S = 100e6
"""The write bandwidth assumed before a save has measured one (a slow shared filesystem)."""


def checkpoint_timeout(
    configured_s: float | None, nbytes: int, bytes_per_s: float | None
) -> tuple[float, str]:
    """The checkpoint phases' timeout for `nbytes` this rank writes or reads, and how it was
    chosen: `fault.checkpoint_timeout_s` where given, else the floor plus SLACK times the time
    those bytes take at the bandwidth the last save measured (or the assumed one)."""
    if configured_s is not None:
        return configured_s, f"fault.checkpoint_timeout_s={configured_s:g}"
    rate = bytes_per_s or CKPT_ASSUMED_BYTES_PER_S
    timeout = CKPT_TIMEOUT_FLOOR_S + CKPT_TIMEOUT_SLACK * nbytes / rate
    source = "measured" if bytes_per_s else "assumed"
    return timeout, (
        f"fault.checkpoint_timeout_s null: {timeout:.0f} s for {nbytes / 1e6:.1f} MB at "
        f"{rate / 1e6:.0f} MB/s {source}"
    )
