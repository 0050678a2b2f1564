"""The `prediction` block of a run's summary.json: the planner's prediction for the run's own
config and hardware, next to what the run measured, row by row with their ratio.

Torch-free: it reads the summary `hpcml train` is about to write (hpcml.train.memprobe calls
it). Step time uses the catalog's default efficiency for the device, which is a guess until
`hpcml plan check --calibrate-with` fits one on other runs; its row says so.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hpcml.plan.check import check_run, setup_from_summary
from hpcml.plan.hardware import Catalog


def predict_summary(summary: Mapping[str, Any], catalog: Catalog) -> dict[str, Any]:
    setup = setup_from_summary(summary, catalog, label=str(summary.get("run_dir", "run")))
    report = check_run(setup)
    lay = setup.layout
    return {
        "planner": "hpcml.plan (plan memory / plan step for this config)",
        "accelerator": setup.cluster.accelerator.key,
        "devices": setup.cluster.devices,
        "layout": {
            "dp": lay.dp(setup.cluster.devices),
            "tp": lay.tp,
            "sp": lay.sp,
            "zero": lay.zero,
            "micro_batch": lay.micro_batch,
            "grad_accum": lay.grad_accum,
            "recompute": lay.recompute,
            "attention": (lay.attention or setup.model.attention)
            if setup.model.is_transformer
            else None,
        },
        "training": {
            "precision": setup.training.precision,
            "weights": setup.training.weight_mode,
            "optimizer": setup.training.optimizer,
        },
        "rows": [r.to_dict() for r in report.rows],
        "step_time_calibrated": report.calibrated,
        "notes": list(report.notes),
    }
