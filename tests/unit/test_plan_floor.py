"""The in-sample floor of the step-time model (hpcml.plan.floor): the best worst-row error any
calibration could reach on a set of runs."""

from __future__ import annotations

import random

import pytest

from hpcml.plan.calibration import CalibrationPoint, calibrate
from hpcml.plan.floor import step_time_floor
from hpcml.plan.hardware import load_catalog, resolve_cluster
from hpcml.plan.memory import Layout, Training
from hpcml.plan.perf import Calibration, step_time
from hpcml.plan.shapes import model_shape

CAT = load_catalog()
TRUTH = Calibration(
    0.05, collective_overhead_s=0.004, tensor_overhead_s=3e-4, tp_tensor_overhead_s=2e-3
)


def _points(noise: float = 0.0, seed: int = 0) -> list[CalibrationPoint]:
    rng = random.Random(seed)
    cluster = resolve_cluster(CAT, 2, accelerator="cpu")
    out = []
    for name in ("gpt-tiny", "mlp", "resnet18", "simple_cnn"):
        m = model_shape(name)
        layouts = [Layout(micro_batch=4), Layout(zero=3, micro_batch=4)]
        if m.is_transformer:
            layouts.append(Layout(tp=2, micro_batch=4))
        for lay in layouts:
            t = step_time(m, lay, Training("fp32"), cluster, TRUTH).step_s
            t *= 1.0 + rng.uniform(-noise, noise)
            out.append(
                CalibrationPoint(
                    m, lay, Training("fp32"), cluster, t, f"{name}/{lay.zero}/{lay.tp}"
                )
            )
    return out


def test_runs_the_model_describes_exactly_have_a_floor_near_zero() -> None:
    floor = step_time_floor(_points())
    # Only the efficiency is searched on a grid (fine step: ln(4e4)/120/40 = 0.22% in log),
    # so the compute term, and the worst row with it, can be off by at most about 0.22%.
    assert floor.worst < 2.5e-3
    assert floor.calibration.efficiency == pytest.approx(0.05, rel=3e-3)
    assert all(r == pytest.approx(1.0, abs=2.5e-3) for r in floor.ratios)


def test_two_identical_runs_measured_a_factor_two_apart_leave_a_third() -> None:
    """The model predicts the same p for both; the best p is 4m/3, off by 1/3 from each."""
    p = _points()[0]
    q = CalibrationPoint(p.model, p.layout, p.training, p.cluster, 2 * p.measured_step_s, "twice")
    floor = step_time_floor([p, q])
    assert floor.worst == pytest.approx(1 / 3, rel=1e-6)
    assert floor.ratios[0] == pytest.approx(4 / 3, rel=1e-6)
    assert sorted(floor.binding([p, q])) == sorted([p.label, "twice"])


def test_the_floor_is_never_worse_than_the_least_squares_fit() -> None:
    """With seeded noise of up to 20%, the minimax fit's worst row is at most the worst row of
    `calibrate` (least squares on log ratios) on the same runs, and it is above zero: the
    noise is not something any calibration can explain."""
    pts = _points(noise=0.2, seed=7)
    floor = step_time_floor(pts)
    fit = calibrate(pts)
    worst_lsq = max(abs(1 / r - 1) for r in fit.residuals)
    assert 0.01 < floor.worst <= worst_lsq + 1e-9
    assert max(abs(r - 1) for r in floor.ratios) == pytest.approx(floor.worst, rel=1e-6)
