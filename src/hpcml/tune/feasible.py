"""Whether a trial's config fits its device, asked of the planner before the trial starts.

`tune.device` names a hardware catalog entry; the planner predicts the peak bytes per device
of the trial's own config on `--nproc` of them (what `hpcml plan memory` prints), and a config
that does not fit in the usable share of the device's memory is infeasible: recorded, never
launched. Without `tune.device` every config is feasible (a CPU run is not checked).
"""

from __future__ import annotations

from dataclasses import dataclass

from hpcml.config import RunConfig, TuneConfig
from hpcml.errors import ConfigError


@dataclass(frozen=True)
class Fit:
    fits: bool
    predicted_bytes: float
    usable_bytes: float
    device: str

    @property
    def violation(self) -> float:
        """Optuna's constraint value: > 0 when infeasible (the share by which it is over)."""
        return self.predicted_bytes / self.usable_bytes - 1.0

    def reason(self) -> str:
        return (
            f"the planner predicts {self.predicted_bytes / 1e9:.2f} GB per device, over the "
            f"{self.usable_bytes / 1e9:.2f} GB usable on {self.device}"
        )


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
    from hpcml.plan.check import setup_from_summary
    from hpcml.plan.hardware import load_catalog
    from hpcml.plan.memory import CUDA_RESERVE_BYTES, USABLE_FRACTION, per_device_bytes

    catalog = load_catalog(tune.catalog)
    # The same mapping from a config to a plan that `hpcml plan check` applies to a run.
    setup = setup_from_summary(
        {
            "config": cfg.model_dump(mode="json"),
            "world_size": nproc,
            "device": {"type": "cuda", "name": tune.device},
            "precision": cfg.precision,
        },
        catalog,
        label="tune trial",
    )
    acc = setup.cluster.accelerator
    mem = per_device_bytes(
        setup.model, setup.layout, setup.training, setup.cluster.devices, acc.memory_bytes
    )
    usable = max(1.0, USABLE_FRACTION * float(acc.memory_bytes or 0) - CUDA_RESERVE_BYTES)
    return Fit(mem.fits(), mem.total_bytes, usable, acc.key)
