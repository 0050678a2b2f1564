"""`plan check` that cannot agree with itself: real `hpcml train` runs of three zoo models
(gpt-tiny, mlp, simple_cnn; one CPU process, a few steps, in this process to spare start-ups)
predicted with step time calibrated on the *other* models only, and memory compared as saved
activations and states + activations, measured by the run's own probe.

The memory check can fail: a planner whose activation formula is 30% off fails it (the test
scales plan.memory's transformer formula by 1.3 and watches the rows turn).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import hpcml.plan.memory as plan_memory
from hpcml.cli.app import app
from hpcml.config import build_config
from hpcml.data.sources.tokens import prepare_pystdlib
from hpcml.plan.check import leave_one_model_out, setup_from_summary
from hpcml.plan.hardware import load_catalog
from hpcml.plan.perf import Calibration, step_time
from hpcml.train.engine import run

SYNTH = {"source": "synthetic", "synthetic_samples": 256, "synthetic_shape": [3, 32, 32]}
MODELS: dict[str, dict[str, Any]] = {
    # gpt's run traces its own step (train.plan_trace): its prediction takes the traced
    # activations, with the formula path's beside them.
    "gpt": {"model": {"name": "gpt-tiny"}, "data": {"seq_len": 64, "batch_size": 4},
            "train": {"plan_trace": "always"}},
    "mlp": {"model": {"name": "mlp"}, "data": {**SYNTH, "batch_size": 32}},
    "cnn": {"model": {"name": "simple_cnn"}, "data": {**SYNTH, "batch_size": 4}},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loo")
    corpus = root / "corpus"
    prepare_pystdlib(corpus, val_fraction=0.2, max_bytes=200_000)
    torch.set_num_threads(1)
    out = {}
    for key, spec in MODELS.items():
        data = dict(spec["data"])
        if key == "gpt":
            data.update({"source": "tokens", "path": str(corpus), "eval_windows": 4})
        cfg = {
            "model": spec["model"],
            "data": data,
            "optim": {"name": "adamw", "lr": 0.001},
            "train": {"max_steps": 5, "eval_every": 0, "checkpoint_every": 0, "log_every": 5,
                      **spec.get("train", {})},
            "precision": "fp32",
        }
        out[key] = root / key
        run(build_config(cfg), run_dir=out[key], quiet=True)
    return out


def _reports(runs: dict[str, Path]) -> dict[str, Any]:
    cat = load_catalog()
    setups = [
        setup_from_summary(json.loads((p / "summary.json").read_text()), cat, key)
        for key, p in runs.items()
    ]
    return {r.setup.label: r for r in leave_one_model_out(setups)}


def _row(report: Any, quantity: str) -> Any:
    return next(r for r in report.rows if r.quantity == quantity)


def test_every_run_carries_its_prediction(runs: dict[str, Path]) -> None:
    s = json.loads((runs["gpt"] / "summary.json").read_text())
    rows = {r["quantity"]: r for r in s["prediction"]["rows"]}
    measured = s["memory"]["saved_activation_bytes"]
    assert rows["activations_bytes"]["measured"] == measured > 0
    assert rows["activations_bytes"]["ratio"] == pytest.approx(
        rows["activations_bytes"]["predicted"] / measured
    )
    assert s["prediction"]["layout"]["attention"] == "sdpa"


def test_memory_rows_compare_activations_and_peak(runs: dict[str, Path]) -> None:
    """The peak too: predicted by the run's traced step, measured by allocation tracing of
    the run's own third step (hpcml.train.peaktrace), not the sum of two other rows."""
    for label, rep in _reports(runs).items():
        for q in (
            "model_states_bytes",
            "activations_bytes",
            "states_plus_activations_bytes",
            "peak_bytes",
        ):
            row = _row(rep, q)
            assert row.ok, (label, q, row.ratio)


def test_step_time_is_calibrated_on_other_models_only(runs: dict[str, Path]) -> None:
    for label, rep in _reports(runs).items():
        assert rep.calibrated
        fitted_on = rep.calibration.source
        assert label not in fitted_on.replace("fitted to ", "").split(", "), fitted_on
        assert len(rep.calibration.residuals) == 2  # the two other models' runs


def test_a_planner_30_percent_off_in_activations_fails(
    runs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """gpt's run traced its own step: its prediction takes the traced activations, and the
    formula path is checked beside them (activations_formula_bytes). A formula 30% off fails
    that row; the traced rows stay within 10%."""
    honest = plan_memory.transformer_activation_bytes
    monkeypatch.setattr(
        plan_memory, "transformer_activation_bytes", lambda *a, **k: 1.3 * honest(*a, **k)
    )
    rep = _reports(runs)["gpt"]
    assert not _row(rep, "activations_formula_bytes").ok
    assert _row(rep, "activations_bytes").ok and _row(rep, "states_plus_activations_bytes").ok
    assert _row(rep, "model_states_bytes").ok  # the bug is in the activations only
    (drift,) = [float(n.rsplit("= ", 1)[1]) for n in rep.notes if "the traced step =" in n]
    assert 1.25 < drift < 1.35  # the honest formula is within 1% of the trace here


def test_every_run_uses_its_traced_step(runs: dict[str, Path]) -> None:
    """Issue 37 item 1: the run's prediction block predicts activations from the run's own
    traced step, for its own input shape, and reports the formula path beside it."""
    s = json.loads((runs["gpt"] / "summary.json").read_text())
    traced = s["memory_trace"]["activations_bytes_per_sample"] * s["memory_trace"]["micro_batch"]
    rows = {r["quantity"]: r for r in s["prediction"]["rows"]}
    assert rows["activations_bytes"]["predicted"] == pytest.approx(traced)
    formula = rows["activations_formula_bytes"]
    assert formula["predicted"] != pytest.approx(traced, rel=1e-4)
    # Both paths are measured against the probe's saved bytes, within the 10% goal.
    assert rows["activations_bytes"]["ok"] and formula["ok"]
    # plan_trace auto: every run, a short one too (its trace from the per-user cache when
    # the same step was traced before), for its own input shape
    mlp = json.loads((runs["mlp"] / "summary.json").read_text())
    trace = mlp["memory_trace"]
    assert trace["input_shape"] == [3, 32, 32] and trace["source"] in ("traced", "cache")
    rows = {r["quantity"]: r for r in mlp["prediction"]["rows"]}
    assert rows["activations_bytes"]["predicted"] == pytest.approx(
        trace["activations_bytes_per_sample"] * trace["micro_batch"]
    )
    assert rows["peak_bytes"]["predicted"] == trace["peak_bytes"]


def test_a_run_calibrated_on_itself_is_refused(runs: dict[str, Path]) -> None:
    res = CliRunner().invoke(
        app, ["plan", "check", str(runs["gpt"]), "--calibrate-with", str(runs["gpt"])]
    )
    # A PlanError is a user error: one sentence and exit 2, also in-process.
    assert res.exit_code == 2, res.output
    assert "calibrated on itself" in res.stderr and "Traceback" not in res.output


def _ratio_under(setup: Any, calibration: dict[str, Any]) -> float:
    """predicted / measured step time of a run under a calibration given as JSON."""
    cal = Calibration.from_dict(calibration)
    est = step_time(setup.model, setup.layout, setup.training, setup.cluster, cal)
    return est.step_s / float(setup.measured_step_s)


def test_the_check_verb_prints_every_run(runs: dict[str, Path]) -> None:
    res = CliRunner().invoke(
        app, ["plan", "check", *map(str, runs.values()), "--leave-one-model-out", "--json"]
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    reports = out["reports"]
    assert sorted(Path(r["run"]).name for r in reports) == sorted(runs)
    # The in-sample floor: one calibration fitted on all three runs, minimising the worst
    # row, can do no worse than the best of the leave-one-model-out calibrations applied to
    # all three (the floor is the minimum over every calibration of the model).
    (floor,) = out["floors"]
    assert floor["runs"] == 3
    cat = load_catalog()
    setups = [
        setup_from_summary(json.loads((p / "summary.json").read_text()), cat, str(p))
        for p in runs.values()
    ]
    best_loo = min(
        max(abs(_ratio_under(s, rep["calibration"]) - 1) for s in setups) for rep in reports
    )
    assert floor["worst"] <= best_loo + 1e-9
    # Each model alone has one run here: any calibration can fit it exactly.
    assert all(m["worst"] < 1e-2 for m in floor["per_model"].values())
    one = CliRunner().invoke(app, ["plan", "check", str(runs["mlp"])])
    assert one.exit_code == 0, one.output
    assert "uncalibrated" in one.output and "activations_bytes" in one.output


def test_a_copied_run_is_refused_as_its_own_calibration(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """A copied folder is the same run (its summary keeps the run_dir it was trained in, and
    its measurements to the last digit): calibrating on it is refused like the folder itself."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(runs["gpt"], copy)
    res = CliRunner().invoke(app, ["plan", "check", str(runs["gpt"]), "--calibrate-with",
                                   str(copy)])
    assert res.exit_code == 2, res.output
    assert "calibrated on itself" in res.stderr and "Traceback" not in res.output
    res = CliRunner().invoke(
        app, ["plan", "check", str(runs["gpt"]), str(runs["mlp"]), str(copy),
              "--leave-one-model-out"])
    assert res.exit_code == 2 and "give each run once" in res.stderr, res.output


def test_a_saved_calibration_gives_plan_step_its_interval(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """`plan check --leave-one-model-out --save-calibration` writes the fit on all runs with
    its errors out of sample; `plan step --calibration` predicts with it and prints the 90%
    interval those errors give. Another hardware's calibration is refused in one sentence."""
    from hpcml.plan.interval import half_width_log

    saved = tmp_path / "cpu.json"
    res = CliRunner().invoke(app, ["plan", "check", *map(str, runs.values()),
                                   "--leave-one-model-out", "--save-calibration", str(saved)])
    assert res.exit_code == 0, res.output
    doc = json.loads(saved.read_text())
    cal = Calibration.from_dict(doc["calibration"])
    assert doc["accelerator"] == "cpu" and cal.error_groups == 3 and len(cal.error_log) == 3
    step = ["plan", "step", "--model", "gpt-tiny", "--gpu", "cpu", "--precision", "fp32",
            "--calibration", str(saved), "--json"]
    res = CliRunner().invoke(app, step)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    h = half_width_log(cal)
    assert h is not None
    iv = out["step_interval"]
    assert iv["low_s"] == pytest.approx(out["step"]["step_s"] * math.exp(-h))
    assert iv["high_s"] == pytest.approx(out["step"]["step_s"] * math.exp(h))
    text = CliRunner().invoke(app, step[:-1])
    assert "90% interval" in text.output
    doc["accelerator"] = "h100-sxm"
    saved.write_text(json.dumps(doc))
    res = CliRunner().invoke(app, step)
    assert res.exit_code == 2 and "fitted on h100-sxm runs, not cpu" in res.stderr, res.output
