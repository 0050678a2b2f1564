"""Step-time calibration per collective kind, repeated runs with their noise, the 90% interval
from the calibration's own errors out of sample, and the refusal of runs that are copies."""

from __future__ import annotations

import math
import random
from dataclasses import replace
from typing import Any

import pytest
from scipy.stats import norm, t
from tests.unit.test_plan_check import summary

from hpcml.plan.calibration import CalibrationPoint, calibrate
from hpcml.plan.check import calibrate_from, calibration_points, check_run, setup_from_summary
from hpcml.plan.common import PlanError
from hpcml.plan.hardware import load_catalog, resolve_cluster
from hpcml.plan.interval import half_width_log, step_interval
from hpcml.plan.memory import Layout, Training
from hpcml.plan.perf import Calibration, step_time
from hpcml.plan.shapes import model_shape

CAT = load_catalog()
CLUSTER = resolve_cluster(CAT, 2, accelerator="cpu")
FP32 = Training("fp32")
# ddp: all-reduce buckets; zero1: all-reduce + one broadcast per rank; zero3: all-gathers per
# unit (and gloo's reduce-scatter, an all-reduce). Each kind's count varies across them.
LAYOUTS = (
    Layout(micro_batch=8),
    Layout(zero=1, micro_batch=8, zero1_whole_tensors=True),
    Layout(zero=3, micro_batch=8),
)
MODELS = ("simple_cnn", "resnet18", "gpt-tiny", "mlp")


def _points(truth: Calibration, noise: float = 0.0, seed: int = 0) -> list[CalibrationPoint]:
    rng = random.Random(seed)
    out = []
    for name in MODELS:
        m = model_shape(name)
        for i, lay in enumerate(LAYOUTS):
            step = step_time(m, lay, FP32, CLUSTER, truth).step_s
            step *= math.exp(rng.gauss(0.0, noise)) if noise else 1.0
            out.append(CalibrationPoint(m, lay, FP32, CLUSTER, step, f"{name}-{i}"))
    return out


def test_each_collective_kind_gets_its_own_cost() -> None:
    """Points made with a dearer broadcast than all-reduce and a cheap all-gather: the fit
    finds each kind's cost. One cost for every kind (the calibration before per-kind costs)
    cannot, and leaves residuals."""
    kinds = (("allgather", 0.001), ("allreduce", 0.004), ("broadcast", 0.009))
    truth = Calibration(0.05, tensor_overhead_s=2e-4, collective_costs_s=kinds)
    points = _points(truth)
    fit = calibrate(points)
    # Exact points: limited by the golden-section search's tolerance on the efficiency.
    assert fit.efficiency == pytest.approx(0.05, rel=1e-3)
    for op, cost in kinds:
        assert fit.collective_cost_s(op) == pytest.approx(cost, rel=1e-3), op
    assert all(r == pytest.approx(1.0, rel=1e-5) for r in fit.residuals)
    one = calibrate(points, per_kind=False)
    assert max(abs(r - 1) for r in one.residuals) > 0.02
    # A kind no calibration run issued costs the calls-weighted mean of the fitted ones.
    assert min(c for _, c in kinds) < fit.collective_cost_s("sendrecv") < max(c for _, c in kinds)


def test_the_interval_comes_from_errors_out_of_sample() -> None:
    """The interval's half-width is a Student-t prediction interval on the errors each model's
    runs make under a fit on the *other* models (recomputed here by hand, for the collective
    cost's form, per kind or one for all, that predicts them better), with one degree of
    freedom per model less one. Built from the fit's in-sample residuals instead (which a
    flexible fit shrinks), or from the wrong groups, it would be another number."""
    truth = Calibration(0.05, collective_overhead_s=0.003, tensor_overhead_s=2e-4)
    points = _points(truth, noise=0.15, seed=7)  # seeded scatter, 15% in log

    def errors_of(per_kind: bool) -> list[float]:
        out = []
        for name in MODELS:
            fit = calibrate([p for p in points if p.model.name != name], per_kind=per_kind)
            out += [
                math.log(p.measured_step_s / step_time(p.model, p.layout, FP32, CLUSTER,
                                                       fit).step_s)
                for p in points
                if p.model.name == name
            ]
        return out

    def rms(e: list[float]) -> float:
        return math.sqrt(sum(x * x for x in e) / len(e))

    errors = min(errors_of(False), errors_of(True), key=rms)
    cal = calibrate_from_points(points)
    want = t.ppf(0.95, len(MODELS) - 1) * rms(errors) * math.sqrt(1 + 1 / len(errors))
    assert cal.error_groups == len(MODELS)
    assert sorted(cal.error_log) == pytest.approx(sorted(errors), rel=1e-9)
    assert half_width_log(cal) == pytest.approx(want, rel=1e-9)
    in_sample = rms([math.log(r) for r in cal.residuals])
    assert rms(errors) > 1.2 * in_sample  # out of sample errs more: what the interval carries
    iv = step_interval(0.1, cal)
    assert iv is not None and iv.low_s == pytest.approx(0.1 / math.exp(want))
    assert iv.high_s == pytest.approx(0.1 * math.exp(want))


def calibrate_from_points(points: list[CalibrationPoint]) -> Calibration:
    from hpcml.plan.interval import calibrate_with_error

    return calibrate_with_error(points)


def _run(
    run_dir: str, step_s: float, strategy: str = "ddp", model: str = "simple_cnn", **over: Any
) -> dict[str, Any]:
    s = summary(run_dir=run_dir, throughput={"step_time_s": step_s, "data_wait_s": 0.0}, **over)
    s["config"]["parallel"]["strategy"] = strategy
    s["config"]["model"]["name"] = s["model"]["name"] = model
    s["model"]["args"] = {}
    return s


def test_repeated_runs_fit_as_their_median_with_the_noise_measured() -> None:
    """Three repetitions of one configuration are one calibration point, their median, and
    their spread is the noise: the pooled standard deviation of log step time. The interval is
    never narrower than that noise says one measurement scatters. Repetitions fitted as
    separate points would measure no noise (and weigh the configuration three times)."""
    reps = (0.10, 0.12, 0.11)
    setups = [setup_from_summary(_run(f"/r/a{i}", x), CAT, f"a{i}") for i, x in enumerate(reps)]
    other = setup_from_summary(_run("/r/b", 0.2, "zero3"), CAT, "b")
    (point, _) = calibration_points([*setups, other])
    assert point.measured_step_s == pytest.approx(0.11) and point.repeats_s == reps
    logs = [math.log(x) for x in reps]
    mean = sum(logs) / 3
    sd = math.sqrt(sum((v - mean) ** 2 for v in logs) / 2)
    cal = calibrate_from([*setups, other])
    assert cal.noise_log == pytest.approx(sd, rel=1e-9)
    noisy = replace(cal, error_log=(0.001, -0.001, 0.001), error_groups=3)
    assert half_width_log(noisy) == pytest.approx(norm.ppf(0.95) * sd, rel=1e-9)


def test_a_copy_of_the_checked_run_is_refused_as_calibration() -> None:
    """The same folder, a copied folder (its summary keeps the run_dir it was trained in) and
    the same measurements under another run_dir are all the checked run itself."""
    checked = setup_from_summary(_run("/r/a", 0.1), CAT, "/x/a")
    copies = {
        "same folder": setup_from_summary(_run("/r/a", 0.1), CAT, "/x/a"),
        "copied folder": setup_from_summary(_run("/r/a", 0.1), CAT, "/x/copy"),
        "run_dir edited": setup_from_summary(_run("/r/z", 0.1), CAT, "/x/z"),
    }
    for what, copy in copies.items():
        with pytest.raises(PlanError, match="calibrated on itself"):
            check_run(checked, [copy])
        assert what
    other = setup_from_summary(_run("/r/b", 0.1001), CAT, "/x/b")
    assert check_run(checked, [other]).calibrated


def test_leave_one_model_out_refuses_duplicate_runs() -> None:
    from hpcml.plan.check import leave_one_model_out

    a = setup_from_summary(_run("/r/a", 0.1), CAT, "a")
    b = setup_from_summary(_run("/r/b", 0.3, model="resnet18"), CAT, "b")
    dup = setup_from_summary(_run("/r/b", 0.3, model="resnet18"), CAT, "b-copy")
    assert len(leave_one_model_out([a, b])) == 2
    with pytest.raises(PlanError, match="give each run once"):
        leave_one_model_out([a, b, dup])


def test_no_interval_without_measured_error() -> None:
    s = setup_from_summary(_run("/r/a", 0.1), CAT, "a")
    for cal in (None, Calibration(0.05, source="--efficiency")):
        rep = check_run(s, calibration=cal)
        row = next(r for r in rep.rows if r.quantity == "step_time_s")
        assert row.interval is None
        assert any("no interval on the step time" in n for n in rep.notes)


def test_a_saved_calibration_loads_with_errors_of_either_sign(tmp_path: Any) -> None:
    """Errors are log(measured / predicted), negative for a run predicted too slow: a file
    `plan check --save-calibration` wrote loads whatever their signs; a negative cost, a
    non-number or another hardware's fit is refused in one sentence."""
    import json

    from hpcml.cli.plan.shared import load_calibration

    cal = Calibration(0.05, 0.001, source="fitted", error_log=(-0.3, 0.2, -0.1),
                      error_groups=3, error_basis="each of 3 models")
    path = tmp_path / "cal.json"

    def save(d: dict[str, Any]) -> Any:
        path.write_text(json.dumps({"accelerator": "cpu", "calibration": d}))
        return path

    loaded = load_calibration(save(cal.to_dict()), "cpu")
    assert loaded == cal and half_width_log(loaded) is not None
    for bad, needle in (({"overhead_s": -1.0}, "negative or non-finite"),
                        ({"noise_log": "x"}, "is not a calibration"),
                        ({"error_log": [float("nan")]}, "negative or non-finite")):
        with pytest.raises(PlanError, match=needle):
            load_calibration(save({**cal.to_dict(), **bad}), "cpu")
    with pytest.raises(PlanError, match="fitted on cpu runs, not h100-sxm"):
        load_calibration(save(cal.to_dict()), "h100-sxm")
