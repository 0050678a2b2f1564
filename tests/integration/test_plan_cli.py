"""`hpcml plan` end to end: every verb's JSON and tables, one-sentence errors with exit code 2,
and the verbs that must agree with each other (plan check against real runs lives in
test_plan_check_loo.py)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from tests.conftest import hpcml_proc
from typer.testing import CliRunner

from hpcml.cli.app import app
from hpcml.plan.shapes import model_shape

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src"
runner = CliRunner()


def hpcml(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    return hpcml_proc(list(args), env=env, timeout=300)  # forked (tests/conftest.py)


def invoke_json(*args: str) -> Any:
    result = runner.invoke(app, ["plan", *args, "--json"])
    assert result.exit_code == 0, (result.output, result.exception)
    return json.loads(result.stdout)


def test_memory_json_gives_per_device_bytes() -> None:
    proc = hpcml("plan", "memory", "--model", "llama-7b", "--devices", "64", "--zero", "1",
                 "--recompute", "op", "--grad-accum", "16", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes", "model_states_bytes",
                "activations_bytes", "total_bytes"):
        assert out[key] >= 0, key
    assert out["model_states_bytes"] == pytest.approx(
        out["params_bytes"] + out["grads_bytes"] + out["optimizer_bytes"])
    assert out["params_bytes"] == 2 * out["parameters"]  # bf16 weights, not sharded by ZeRO-1
    assert out["optimizer_bytes"] == pytest.approx(12 * out["parameters"] / 64)
    assert out["fits"] is True and out["dp"] == 64


def test_bad_input_from_the_real_command_is_one_line_and_exit_2() -> None:
    proc = hpcml("plan", "memory", "--model", "llama-7b", "--devices", "64", "--tp", "3")
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "does not divide 64 devices" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) <= 2


@pytest.mark.parametrize(
    "args,needle",
    [
        (["memory", "--model", "llama-7b", "--gpu", "v100"], "not in the hardware catalog"),
        (["advise", "--model", "llama-70b", "--gpu", "l4", "--devices", "2", "--global-batch",
          "8"], "no layout of llama-70b fits"),
        (["memory", "--model", "gpt-5"], "not known to the planner"),
        (["comm", "--size", "lots"], "not understood"),
        (["check", "/nonexistent/run"], "has no summary.json"),
    ],
)
def test_bad_input_raises_user_errors(args: list[str], needle: str) -> None:
    # In-process too, the app turns these into one printed sentence and exit code 2.
    result = runner.invoke(app, ["plan", *args])
    assert result.exit_code == 2, result.output
    err = [line for line in result.stderr.splitlines() if line.strip()]
    assert err[0].startswith("error: ") and needle in " ".join(err), result.stderr
    assert "Traceback" not in result.output


def test_comm_reports_algorithm_and_bus_bandwidth() -> None:
    out = invoke_json("comm", "--size", "1GB", "--devices", "16", "--node", "hgx-h100",
                      "--model", "gpt-1.3b")
    ops = {c["op"]: c for c in out["collectives"]}
    assert set(ops) == {"allreduce", "allgather", "reducescatter", "broadcast", "reduce",
                        "alltoall", "sendrecv"}
    ar = ops["allreduce"]
    assert ar["busbw_bytes_per_s"] == pytest.approx(ar["algbw_bytes_per_s"] * 2 * 15 / 16)
    strategies = {s["strategy"]: s for s in out["strategies"]}
    # The ZeRO paper's 3 Psi against DDP's 2 Psi, less the last of the u units FSDP2 keeps
    # gathered from forward into backward: (3 - 1/u) Psi.
    u = model_shape("gpt-1.3b").gather_units
    assert strategies["ZeRO-3 / FSDP"]["volume_bytes"] == pytest.approx(
        (3 - 1 / u) / 2 * strategies["DDP"]["volume_bytes"])
    assert any(name.startswith("TP=8") for name in strategies)


def test_step_json_and_scaling_plot(tmp_path: Path) -> None:
    png = tmp_path / "scaling.png"
    out = invoke_json("step", "--model", "llama-7b", "--devices", "64", "--zero", "1",
                      "--recompute", "op", "--grad-accum", "8", "--scaling",
                      "8,16,32,64", "--plot", str(png))
    step = out["step"]
    assert step["step_s"] == pytest.approx(
        step["compute_s"] + step["critical_comm_s"] + step["bubble_s"]
        + step["exposed_dp_comm_s"] + step["optimizer_s"] + step["overhead_s"])
    assert 0 < step["mfu"] < 1
    assert [r["devices"] for r in out["scaling"]] == [8, 16, 32, 64]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_advise_json_ranks_and_explains() -> None:
    out = invoke_json("advise", "--model", "llama-7b", "--devices", "64", "--global-batch",
                      "512", "--top", "3")
    assert len(out["candidates"]) == 3
    steps = [c["step"]["step_s"] for c in out["candidates"]]
    assert steps == sorted(steps)
    assert out["why"].startswith(out["candidates"][0]["label"])


def test_cost_verbs(tmp_path: Path) -> None:
    run = invoke_json("cost", "run", "--model", "llama-7b", "--tokens", "2e12", "--devices",
                      "64", "--gpu", "h100-sxm", "--gpu", "a100-80gb", "--mfu", "0.4")
    by = {o["accelerator"]: o for o in run["options"]}
    assert by["a100-80gb"]["gpu_hours"] > by["h100-sxm"]["gpu_hours"]
    assert by["h100-sxm"]["cost_usd"] == pytest.approx(
        by["h100-sxm"]["gpu_hours"] * by["h100-sxm"]["usd_per_gpu_hour"])
    png = tmp_path / "tco.png"
    tco = invoke_json("cost", "tco", "--gpu", "h100-sxm", "--devices", "64", "--cloud-price",
                      "2.99", "--plot", str(png))
    assert tco["break_even_month"] is None or tco["break_even_month"] > 0
    assert png.is_file()
    spot = invoke_json("cost", "spot", "--on-demand-price", "12.29", "--discount", "0.6",
                       "--preemptions-per-hour", "0.05", "--instances", "8")
    assert spot["daly_interval_s"] < spot["young_interval_s"]
    assert 0 < spot["spot_goodput"] < 1


def test_hardware_and_models_tables() -> None:
    result = runner.invoke(app, ["plan", "hardware"])
    assert result.exit_code == 0 and "h100-sxm" in result.stdout and "nvlink4" in result.stdout
    models = invoke_json("models")
    assert {"gpt2-small", "llama-7b", "simple_cnn", "resnet18", "mlp"} <= {
        m["name"] for m in models}


# --- plan check against a measured run --------------------------------------------------------


def test_spot_and_checkpoint_interval_give_one_goodput() -> None:
    # Daly 2006's case (checkpoint 5 min, MTBF 15 min): both verbs call plan.cost.checkpoint_plan.
    spot = invoke_json("cost", "spot", "--on-demand-price", "10", "--discount", "0.6",
                       "--preemptions-per-hour", "4", "--instances", "1", "--checkpoint-s", "300",
                       "--restart-s", "0")
    res = runner.invoke(app, ["launch", "checkpoint-interval", "--checkpoint-s", "300", "--mtbf",
                              "15m", "--restart-s", "0", "--json"])
    assert res.exit_code == 0, res.output
    advice = json.loads(res.stdout)
    assert advice["expected_goodput"] == pytest.approx(spot["spot_goodput"], rel=1e-12)
    assert advice["daly_interval_s"] == pytest.approx(spot["daly_interval_s"], rel=1e-12)


def test_cost_run_applies_recomputation_like_the_library() -> None:
    # Narayanan et al. 2021, Sec. 5.1: GPT-3 175B on 300B tokens with 1024 A100s at 140
    # TFLOP/s each (full recomputation, 8TP FLOPs) takes about 34 days.
    args = ["cost", "run", "--model", "gpt3-175b", "--tokens", "300e9", "--gpu", "a100-80gb",
            "--devices", "1024", "--mfu", str(140 / 312), "--tp", "8", "--pp", "8"]
    full = invoke_json(*args, "--recompute", "full")["options"][0]
    assert full["wall_hours"] / 24 == pytest.approx(34, rel=0.03)
    none = invoke_json(*args)["options"][0]
    assert none["wall_hours"] < 0.8 * full["wall_hours"]  # 6TP instead of 8TP FLOPs


def test_params_alone_under_zero3_is_refused_in_one_sentence() -> None:
    proc = hpcml("plan", "memory", "--params", "7e9", "--devices", "64", "--zero", "3")
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "--largest-layer" in proc.stderr and "Traceback" not in proc.stderr
    ok = hpcml("plan", "memory", "--params", "7e9", "--devices", "64", "--zero", "3",
               "--largest-layer", "2e8", "--json")
    assert ok.returncode == 0, ok.stderr
    z2 = hpcml("plan", "memory", "--params", "7e9", "--devices", "64", "--zero", "2", "--json")
    assert json.loads(ok.stdout)["total_bytes"] < json.loads(z2.stdout)["total_bytes"]
