"""Whether a trial's config fits its device, asked of the planner before the trial starts.

`tune.device` names a hardware catalog entry; the planner predicts the peak bytes per device
of the trial's own config on `--nproc` of them (what `hpcml plan memory` prints), and a config
that does not fit in the usable share of the device's memory is infeasible: recorded, never
launched. Without `tune.device` every config is feasible (a CPU run is not checked).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hpcml.config import RunConfig, TuneConfig
from hpcml.errors import ConfigError

if TYPE_CHECKING:
    from hpcml.plan.fit import Fit


def check_device(tune: TuneConfig) -> None:
    """Refuse an unknown `tune.device` before any trial starts."""
    if tune.device is None:
        return
    from hpcml.plan.hardware import load_catalog, match_accelerator

    acc = match_accelerator(load_catalog(tune.catalog), tune.device)
    if acc is None or not acc.memory_bytes:
        raise ConfigError(
            f"tune.device '{tune.device}' is not an accelerator with memory in the hardware "
            "catalog; name one listed by `hpcml plan hardware` or add it with tune.catalog."
        )


def memory_fit(cfg: RunConfig, nproc: int, tune: TuneConfig) -> Fit | None:
    """The planner's verdict for `cfg` on `nproc` devices of `tune.device`, or None."""
    if tune.device is None:
        return None
    from hpcml.plan.fit import memory_fit as plan_fit
    from hpcml.plan.hardware import load_catalog

    catalog = load_catalog(tune.catalog)
    return plan_fit(cfg.model_dump(mode="json"), cfg.precision, nproc, tune.device, catalog)
