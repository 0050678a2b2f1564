"""The best any calibration of the step-time model could do on a set of measured runs.

`plan check --leave-one-model-out` reports how far predictions land from measurements when
each run is predicted by a calibration fitted on *other* runs. A miss there has two possible
causes: the calibration did not transfer (out-of-sample error), or the model's form cannot
describe the runs at all. This module separates them. It fits every coefficient the model has
(efficiency, per-step overhead, costs per call of each collective kind, per parameter tensor and per tensor
under tensor parallelism) on the runs themselves, in-sample, minimising the worst
|predicted / measured - 1|. No single calibration of the model can put every one of those runs
closer than that floor. Computed on one model's runs alone, it bounds every calibration's
worst row on that model, out-of-sample ones included (a leave-one-model-out calibration is one
calibration applied to all of the model's runs): if a model's own floor exceeds a goal, the
goal needs a different model form, not a better fit.

For a fixed efficiency the software terms are linear, so the worst-row minimum is a small
linear program (scipy's HiGHS `linprog`; scipy comes with scikit-learn, a dependency); the
efficiency is searched on a log grid and refined around the best grid point.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hpcml.plan.calibration import CalibrationPoint, software_counts, with_costs
from hpcml.plan.check import RunSetup, calibration_points, model_key, model_label
from hpcml.plan.common import PlanError
from hpcml.plan.perf import Calibration, step_time


@dataclass(frozen=True)
class Floor:
    worst: float
    """The smallest possible max |predicted / measured - 1| over the points."""
    calibration: Calibration
    ratios: tuple[float, ...]
    """predicted / measured of each point under that calibration."""

    def binding(self, points: Sequence[CalibrationPoint], tol: float = 1e-6) -> list[str]:
        """Labels of the points at the floor: the runs the model cannot bring closer."""
        return [
            p.label
            for p, r in zip(points, self.ratios, strict=True)
            if abs(r - 1) >= self.worst - tol
        ]


def _counts(points: Sequence[CalibrationPoint]) -> tuple[list[str], list[list[float]]]:
    """The software terms some point uses (the per-step overhead's 1, each collective kind
    issued, tensors, tensors under TP) and each point's counts of them."""
    counts = [software_counts(p) for p in points]
    terms = [t for t in counts[0] if any(c[t] for c in counts)]
    return terms, [[c[t] for t in terms] for c in counts]


def _minimax(base: Sequence[float], counts: Sequence[Sequence[float]], measured: Sequence[float]):
    """min g over x >= 0 with |(base_i + counts_i . x) / m_i - 1| <= g for every i."""
    import numpy as np
    from scipy.optimize import linprog

    m = np.asarray(measured, dtype=float)
    a = np.asarray(counts, dtype=float) / m[:, None]
    r0 = np.asarray(base, dtype=float) / m - 1.0
    k, n = a.shape[1], len(m)
    ones = np.ones((n, 1))
    a_ub = np.vstack([np.hstack([a, -ones]), np.hstack([-a, -ones])])
    b_ub = np.concatenate([-r0, r0])
    res = linprog(
        np.r_[np.zeros(k), 1.0],
        A_ub=a_ub,
        b_ub=b_ub,
        bounds=[(0, None)] * (k + 1),
        method="highs",
    )
    if res.status != 0:  # pragma: no cover - the problem is always feasible (g unbounded)
        raise PlanError(f"the floor's linear program failed: {res.message}")
    return float(res.x[-1]), [float(v) for v in res.x[:k]]


def step_time_floor(points: Sequence[CalibrationPoint], overlap: float = 1.0) -> Floor:
    """The in-sample minimax calibration of `points` and the worst relative error it leaves."""
    if not points:
        raise PlanError("the floor needs at least one measured run.")
    measured = [p.measured_step_s for p in points]
    if not all(m > 0 for m in measured):
        raise PlanError("every run of the floor needs a positive measured step time.")
    terms, counts = _counts(points)

    def at(eff: float) -> tuple[float, list[float]]:
        base = [
            step_time(p.model, p.layout, p.training, p.cluster, Calibration(eff), overlap).step_s
            for p in points
        ]
        return _minimax(base, counts, measured)

    # The worst row as a function of the efficiency need not be unimodal: a grid over
    # (1e-4, 4) first, then a finer grid around its best point.
    grid = [
        math.exp(math.log(1e-4) + i * (math.log(4.0) - math.log(1e-4)) / 120) for i in range(121)
    ]
    best = min(grid, key=lambda e: at(e)[0])
    step = (math.log(4.0) - math.log(1e-4)) / 120
    fine = [best * math.exp((i - 40) * step / 40) for i in range(81)]
    eff = min(fine, key=lambda e: at(e)[0])
    worst, x = at(eff)
    cal = with_costs(
        eff, dict(zip(terms, x, strict=True)), f"in-sample minimax over {len(points)} run(s)"
    )
    ratios = tuple(
        step_time(p.model, p.layout, p.training, p.cluster, cal, overlap).step_s / p.measured_step_s
        for p in points
    )
    return Floor(worst, cal, ratios)


def floors(setups: Sequence[RunSetup], overlap: float = 1.0) -> list[dict[str, Any]]:
    """The floor of each hardware's runs together and of each model's runs alone (runs
    without a measured step time are skipped), as plain data for JSON and tables."""
    out = []
    for acc in dict.fromkeys(s.cluster.accelerator.key for s in setups):
        mine = [s for s in setups if s.cluster.accelerator.key == acc and s.measured_step_s]
        if not mine:
            continue
        whole, pts = _floor_of(mine, overlap)
        per_model = {}
        for key in dict.fromkeys(model_key(s.model) for s in mine):
            runs = [s for s in mine if model_key(s.model) == key]
            f, p = _floor_of(runs, overlap)
            per_model[model_label(runs[0].model)] = {
                "runs": len(p),  # repetitions of a configuration are one run: their median
                "worst": f.worst,
                "binding": f.binding(p),
            }
        out.append(
            {
                "accelerator": acc,
                "runs": len(pts),
                "worst": whole.worst,
                "binding": whole.binding(pts),
                "calibration": whole.calibration.to_dict(),
                "per_model": per_model,
            }
        )
    return out


def _floor_of(setups: Sequence[RunSetup], overlap: float) -> tuple[Floor, list[CalibrationPoint]]:
    pts = calibration_points(setups)
    return step_time_floor(pts, overlap), pts
