"""How sure a step-time prediction is: a 90% interval from the calibration's own errors out
of sample, never from its in-sample residuals (which a flexible fit drives to zero).

A calibration fitted on runs of several models is refitted once per model with that model's
runs left out, and each left-out run is predicted: log(measured / predicted) over those runs
is what the calibration does on a model it has not seen, the situation of every prediction it
makes. With runs of one model only, each run is left out in turn instead. The interval is a
Student-t prediction interval on those errors (their root mean square, with one degree of
freedom per left-out group less one, since runs of one model err together), and never narrower
than the run-to-run noise measured on repeated runs says a single measurement scatters.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from hpcml.plan.calibration import CalibrationPoint, calibrate
from hpcml.plan.perf import Calibration, step_time

LEVEL = 0.90


@dataclass(frozen=True)
class Interval:
    low_s: float
    high_s: float
    level: float
    half_width_log: float
    """the interval is prediction x exp(+-half_width_log)."""
    basis: str

    def contains(self, measured_s: float) -> bool:
        return self.low_s <= measured_s <= self.high_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "low_s": self.low_s,
            "high_s": self.high_s,
            "level": self.level,
            "half_width_log": self.half_width_log,
            "basis": self.basis,
        }


def model_group(p: CalibrationPoint) -> Hashable:
    """A model is its architecture and size (as plan check's leave-one-model-out holds out)."""
    return p.model.name, p.model.params


def out_of_sample_errors(
    points: Sequence[CalibrationPoint],
    group: Callable[[CalibrationPoint], Hashable] = model_group,
    overlap: float = 1.0,
    per_kind: bool = True,
) -> tuple[tuple[float, ...], int, str]:
    """log(measured / predicted) of every point, predicted by a calibration fitted without its
    group (leave-one-group-out), the number of groups left out, and the basis in words; no
    errors where there are fewer than two groups and fewer than three points."""
    keys = list(dict.fromkeys(group(p) for p in points))
    if len(keys) >= 2:
        held = [[p for p in points if group(p) == k] for k in keys]
        basis = f"each of {len(keys)} models' runs predicted by a fit on the other models"
    elif len(points) >= 3:
        held = [[p] for p in points]
        basis = f"each of {len(points)} runs of one model predicted by a fit on the others"
    else:
        return (), 0, "fewer than 3 calibration runs: the error out of sample is not measured"
    errors = []
    for out in held:
        rest = [p for p in points if all(p is not q for q in out)]
        cal = calibrate(rest, overlap=overlap, per_kind=per_kind)
        for p in out:
            pred = step_time(p.model, p.layout, p.training, p.cluster, cal, overlap).step_s
            errors.append(math.log(p.measured_step_s / pred))
    return tuple(errors), len(held), basis


def calibrate_with_error(
    points: Sequence[CalibrationPoint],
    overlap: float = 1.0,
    group: Callable[[CalibrationPoint], Hashable] = model_group,
) -> Calibration:
    """`calibrate`, with the calibration's own out-of-sample errors attached. The software
    cost of a collective call is fitted per kind or as one cost for every kind, whichever
    predicts the calibration runs' left-out models better (the smaller root-mean-square
    error; one cost on a tie): per-kind costs always fit the runs themselves at least as well,
    which says nothing about a model they have not seen (on hpcml's CPU table they fitted
    in sample better and predicted other models worse)."""
    forms = {}
    for per_kind in (False, True):
        errors, groups, basis = out_of_sample_errors(points, group, overlap, per_kind)
        rms = math.sqrt(sum(e * e for e in errors) / len(errors)) if errors else math.inf
        forms[per_kind] = (rms, errors, groups, basis)
    per_kind = forms[True][0] < forms[False][0]
    _, errors, groups, basis = forms[per_kind]
    cal = calibrate(points, overlap=overlap, per_kind=per_kind)
    form = "a software cost per collective kind" if per_kind else "one cost for every collective"
    if errors:
        basis += f" ({form}: the form that predicted them better)"
    return replace(cal, error_log=errors, error_basis=basis, error_groups=groups)


def half_width_log(cal: Calibration, level: float = LEVEL) -> float | None:
    """Half-width in log of the interval a calibration's errors give; None when unmeasured."""
    # scipy.special's quantiles, not scipy.stats' (the same functions underneath): every run's
    # prediction block calls this, and importing scipy.stats cost each run ~0.6-1 CPU s more.
    from scipy.special import ndtri, stdtrit

    e = cal.error_log
    if len(e) < 2 or cal.error_groups < 2:
        return None
    n = len(e)
    dof = max(1, cal.error_groups - 1)
    rms = math.sqrt(sum(x * x for x in e) / n)
    h = float(stdtrit(dof, 0.5 + level / 2)) * rms * math.sqrt(1 + 1 / n)
    if cal.noise_log is not None:
        h = max(h, float(ndtri(0.5 + level / 2)) * cal.noise_log)
    return h


def step_interval(step_s: float, cal: Calibration, level: float = LEVEL) -> Interval | None:
    h = half_width_log(cal, level)
    if h is None:
        return None
    noise = "" if cal.noise_log is None else f"; run-to-run noise {cal.noise_log:.1%} (log sd)"
    return Interval(
        step_s * math.exp(-h),
        step_s * math.exp(h),
        level,
        h,
        f"{cal.error_basis}{noise}",
    )


def no_interval_reason(cal: Calibration) -> str:
    """Why a calibration gives no interval, and how to get one."""
    how = (
        "fit one on measured runs with `hpcml plan check RUN_DIR ... --leave-one-model-out "
        "--save-calibration FILE` and pass --calibration FILE"
    )
    if cal.source == "catalog default":
        return f"uncalibrated (the catalog's default efficiency is a guess); {how}"
    if cal.source == "--efficiency":
        return f"an efficiency given by hand has no measured error; {how}"
    return cal.error_basis or f"the calibration holds no errors measured out of sample; {how}"
