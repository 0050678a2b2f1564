"""Saved activations per pipeline stage (`parallel.pp`): the micro-batches each stage holds at
its peak under its schedule, times what one micro-batch of that stage keeps for backward (its
blocks; the output layer on the last stage, the embedding's dropout mask on the first), from
the same formulas as `plan.memory` gives the busiest stage. Pure functions over a run's
summary (no torch, no I/O).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from hpcml.plan.common import get_path
from hpcml.plan.hardware import Catalog
from hpcml.plan.memory import stage_activation_terms
from hpcml.plan.run_setup import setup_from_summary


def stage_inflight_microbatches(
    pp: int, microbatches: int, schedule: str, stage: int
) -> int | None:
    """Micro-batches whose activations stage `stage` of `pp` holds at once, at its peak.
    GPipe runs every forward before the first backward: all m on every stage. 1F1B
    (Narayanan et al. 2021, Sec. 2.2.1): stage s starts p - s forwards before its first
    backward and then alternates, so it holds min(p - s, m) (the first stage the most, the
    planner's `inflight_microbatches`). None: the interleaved and zero-bubble schedules are
    not modelled per stage."""
    if schedule == "gpipe":
        return microbatches
    if schedule == "1f1b":
        return min(pp - stage, microbatches)
    return None


def predict_stages(summary: Mapping[str, Any], catalog: Catalog) -> list[dict[str, Any]]:
    """One row per stage: the planner's in-flight micro-batches and saved-activation bytes
    beside the run's measured peak (summary.json's `pipeline.activations_per_rank`, the
    busiest rank holding the stage) and the in-flight micro-batches it implies (the peak over
    the step's mean bytes per micro-batch)."""
    pipe = summary.get("pipeline") or {}
    config = summary.get("config") or {}
    pp = int(get_path(config, "parallel", "pp", default=1))
    m = int(pipe.get("microbatches") or pp)
    schedule = str(pipe.get("schedule") or "1f1b")
    setup = setup_from_summary(summary, catalog, label=str(summary.get("run_dir", "run")))
    model = setup.formula_model or setup.model
    batch = int(get_path(config, "data", "batch_size", default=1))
    layout = replace(setup.layout, pp=pp, micro_batch=batch // m, grad_accum=m)
    per_mb: tuple[float, float, float, float] | None = None
    if model.is_transformer:
        per_mb = stage_activation_terms(model, layout, setup.training.activation_bytes)
    rows = []
    for stage in range(pp):
        measured = [
            r
            for r in pipe.get("activations_per_rank") or []
            if r.get("stages") == [stage] and r.get("peak_bytes") is not None
        ]
        busiest = max(measured, key=lambda r: r["peak_bytes"], default=None)
        inflight = stage_inflight_microbatches(pp, m, schedule, stage)
        predicted = None
        if per_mb is not None and inflight is not None:
            blocks, output, embed_mask, _ = per_mb
            first, last = stage == 0, stage == pp - 1
            one = blocks + (embed_mask if first else 0.0) + (output if last else 0.0)
            predicted = inflight * one
        rows.append(
            {
                "stage": stage,
                "predicted_inflight_microbatches": inflight,
                "measured_inflight_microbatches": _inflight(busiest),
                "predicted_activation_bytes": predicted,
                "measured_activation_bytes": busiest["peak_bytes"] if busiest else None,
                "ratio": predicted / busiest["peak_bytes"]
                if predicted is not None and busiest and busiest["peak_bytes"]
                else None,
            }
        )
    return rows


def _inflight(rank: Mapping[str, Any] | None) -> float | None:
    if rank is None or not rank.get("bytes_per_microbatch"):
        return None
    return float(rank["peak_bytes"]) / float(rank["bytes_per_microbatch"])
