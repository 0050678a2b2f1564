"""Issue 37, item 5 and the zoo CNN fallback: `plan memory` reports headroom (flagging margins
under 10%), grouped-query heads must divide the heads, options a model path would ignore are
refused in one sentence, and `plan check` no longer predicts a zoo CNN at another input size
with its 3x32x32 table entry."""

from __future__ import annotations

import json
from typing import Any

import pytest
from typer.testing import CliRunner

from hpcml.cli.app import app
from hpcml.plan.check import setup_from_summary
from hpcml.plan.hardware import load_catalog
from hpcml.plan.headroom import headroom_verdict
from hpcml.plan.shapes import model_shape

runner = CliRunner()


def _plan(*args: str) -> Any:
    return runner.invoke(app, ["plan", *args])


def test_headroom_verdict_says_how_much_and_flags_thin_margins() -> None:
    line, thin = headroom_verdict(95e9, 100e9)
    assert thin and line.startswith("fits with 5.00 GB headroom (5.0% of the budget)")
    assert "under 10%" in line
    line, thin = headroom_verdict(80e9, 100e9)
    assert not thin and line == "fits with 20.00 GB headroom (20.0% of the budget)"
    line, thin = headroom_verdict(103e9, 100e9)
    assert thin and line.startswith("does NOT fit: 3.00 GB over the budget (3.0%)")


def test_memory_reports_headroom_and_flags_a_thin_one() -> None:
    args = ("memory", "--model", "llama-7b", "--devices", "64", "--zero", "3", "--grad-accum", "16")
    result = _plan(*args, "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    cap = out["device_memory_bytes"]
    assert out["budget_bytes"] == pytest.approx(0.9 * cap - 1e9)
    assert out["headroom_bytes"] == pytest.approx(out["budget_bytes"] - out["total_bytes"])
    assert out["fits"] is True and out["thin_headroom"] is False
    # A budget 5% above the peak: still fits, flagged.
    usable = (1.05 * out["total_bytes"] + 1e9) / cap
    thin = _plan(*args, "--usable", f"{usable:.6f}")
    assert thin.exit_code == 0, thin.output
    text = " ".join(thin.stdout.split())
    assert "fits with" in text and "(4.8% of the budget); under 10%" in text, text


@pytest.mark.parametrize(
    "args,needle",
    [
        (
            ["--layers", "2", "--hidden", "256", "--heads", "8", "--kv-heads", "3"],
            "3 key/value heads do not divide 8 attention heads",
        ),
        (
            ["--params", "7e9", "--swiglu"],
            "--swiglu is not used when the model is given by --params alone",
        ),
        (
            ["--params", "7e9", "--seq", "4096", "--vocab", "32000"],
            "--vocab, --seq are not used when the model is given by --params alone",
        ),
        (
            ["--model", "llama-7b", "--params", "1e9", "--hidden", "64"],
            "--params, --hidden are not used when --model llama-7b is given",
        ),
        (
            ["--layers", "2", "--hidden", "64", "--heads", "4", "--flops-per-sample", "1e9"],
            "--flops-per-sample is not used when the model is a transformer",
        ),
        (["--model", "resnet18", "--seq", "128"], "--seq is ignored by --model resnet18"),
    ],
)
def test_options_a_path_ignores_are_refused(args: list[str], needle: str) -> None:
    result = _plan("memory", *args)
    assert result.exit_code == 2, result.output
    err = " ".join(result.stderr.split())
    assert err.startswith("error: ") and needle in err, err
    assert len([ln for ln in result.stderr.splitlines() if ln.strip()]) <= 2


def _cnn_summary(side: int, trace: dict[str, Any] | None = None) -> dict[str, Any]:
    summary: dict[str, Any] = {
        "status": "finished",
        "world_size": 1,
        "device": {"type": "cpu", "name": "cpu", "count": 2},
        "precision": "fp32",
        "config": {
            "model": {"name": "resnet18", "args": {}},
            "data": {"source": "synthetic", "batch_size": 8, "synthetic_shape": [3, side, side]},
        },
        "model": {
            "name": "resnet18",
            "args": {"num_classes": 10, "in_channels": 3},
            "parameters": 11_173_962,
            "forward_flops_per_sample": 1_110_845_440 * (side // 32) ** 2,
            "input_shape": [3, side, side],
        },
    }
    if trace is not None:
        summary["memory_trace"] = trace
    return summary


def test_check_does_not_answer_another_input_size_with_the_32px_table() -> None:
    cat = load_catalog()
    table = model_shape("resnet18")
    at32 = setup_from_summary(_cnn_summary(32), cat)
    assert at32.model.activation_bytes_per_sample == table.activation_bytes_per_sample
    at64 = setup_from_summary(_cnn_summary(64), cat)
    assert at64.model.activation_bytes_per_sample is None  # not the table's 4,700,208 B
    assert at64.model.forward_flops_per_sample == 4 * table.forward_flops_per_sample
    assert any("at 3x64x64" in n for n in at64.notes), at64.notes
    traced = setup_from_summary(_cnn_summary(64, {"activations_bytes_per_sample": 1.9e7}), cat)
    assert traced.model.activation_bytes_per_sample == 1.9e7
    # Another class count is not the table's model either.
    other = _cnn_summary(32)
    other["model"]["args"]["num_classes"] = 100
    assert setup_from_summary(other, cat).model.activation_bytes_per_sample is None


def test_advise_flags_a_winner_with_thin_headroom() -> None:
    """Issue 37 item 5 in `plan advise`: the winner's margin is stated, and where it is under
    10% of the budget the fastest layout that leaves more is named with its price in speed.
    The budget is set so that the unconstrained winner keeps 5%, then 15%."""
    from hpcml.plan.advise import advise
    from hpcml.plan.hardware import resolve_cluster
    from hpcml.plan.memory import Training

    m = model_shape("llama-7b")
    cluster = resolve_cluster(load_catalog(), 8, node="hgx-h100")
    cap = cluster.accelerator.memory_bytes
    first = advise(m, Training(), cluster, global_batch=64, top=1)
    best = first.candidates[0]

    def at(headroom: float) -> Any:
        # A budget under the default one: no layout that did not fit before fits now, so the
        # winner stays the fastest of those that do.
        budget = best.memory.total_bytes / (1 - headroom)
        assert budget <= first.usable_bytes
        return advise(m, Training(), cluster, global_batch=64, top=1,
                      reserve_bytes=0.9 * cap - budget)

    thin = at(0.05)
    assert thin.candidates[0].label() == best.label()
    assert "(5.0% of the budget); under 10%" in thin.why
    roomy = thin.why.split("the fastest layout with 10% headroom, ")[1].split(", is ")[0]
    assert roomy != best.label()
    wide = at(0.15)
    assert wide.candidates[0].label() == best.label()
    assert "(15.0% of the budget)" in wide.why and "under 10%" not in wide.why
    assert "the fastest layout with 10% headroom" not in wide.why


def test_advise_json_gives_each_layout_its_headroom() -> None:
    args = ("advise", "--model", "gpt2-small", "--gpu", "l4", "--devices", "2",
            "--global-batch", "16", "--top", "3", "--json")
    result = _plan(*args)
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    for c in out["candidates"]:
        total = c["memory"]["total_bytes"]
        assert c["headroom_bytes"] == pytest.approx(out["usable_bytes"] - total)
        assert c["thin_headroom"] == (c["headroom_bytes"] < 0.10 * out["usable_bytes"])
        assert c["step_interval"] is None  # uncalibrated: no interval, and the reason says so
