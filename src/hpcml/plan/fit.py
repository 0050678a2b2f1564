"""Whether a training config fits its devices' memory: the planner's per-device peak bytes
(what `hpcml plan memory` prints) against the usable share of the accelerator's memory.

Asked before anything starts: by `hpcml tune` for each trial (`tune.device`) and by
`hpcml launch k8s --gpu` for the whole job. The config arrives as the plain mapping
`RunConfig.model_dump(mode="json")` gives, so this module stays free of torch and I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hpcml.plan.check import setup_from_summary
from hpcml.plan.hardware import Catalog
from hpcml.plan.memory import CUDA_RESERVE_BYTES, USABLE_FRACTION, per_device_bytes


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


def memory_fit(
    config: Mapping[str, Any], precision: str, devices: int, device_name: str, catalog: Catalog
) -> Fit:
    """The planner's verdict for `config` trained on `devices` accelerators named `device_name`
    (a catalog key or a name its match patterns know); a PlanError names an unknown device."""
    # The same mapping from a config to a plan that `hpcml plan check` applies to a run.
    setup = setup_from_summary(
        {
            "config": config,
            "world_size": devices,
            "device": {"type": "cuda", "name": device_name},
            "precision": precision,
        },
        catalog,
        label="the config",
    )
    acc = setup.cluster.accelerator
    mem = per_device_bytes(
        setup.model, setup.layout, setup.training, setup.cluster.devices, acc.memory_bytes
    )
    usable = max(1.0, USABLE_FRACTION * float(acc.memory_bytes or 0) - CUDA_RESERVE_BYTES)
    return Fit(mem.fits(), mem.total_bytes, usable, acc.key)
