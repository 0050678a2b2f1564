"""The option groups the `hpcml plan` verbs share (hpcml.cli.plan.shared): values reach the
planner unchanged, a verb's own option of the same flag keeps its own default, and the
defaults a verb without an option falls back on are that option's defaults."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import typer.main
from typer.testing import CliRunner

import hpcml.cli.plan  # noqa: F401  (registers the verbs)
from hpcml.cli.app import app
from hpcml.cli.plan.options import app as plan_app
from hpcml.cli.plan.shared import MODEL, OPTIONS, PlanOptions, plan_options

runner = CliRunner()


def _json(*args: str) -> Any:
    result = runner.invoke(app, ["plan", *args, "--json"])
    assert result.exit_code == 0, (result.output, result.exception)
    return json.loads(result.stdout)


def test_every_shared_option_defaults_to_its_field() -> None:
    fields = {f.name: f.default for f in dataclasses.fields(PlanOptions)}
    assert set(fields) == set(OPTIONS)
    assert {n: OPTIONS[n].default for n in OPTIONS} == fields


def test_values_reach_the_planner() -> None:
    out = _json(
        *("memory", "--layers", "8", "--hidden", "512", "--heads", "8", "--seq", "256"),
        *("--devices", "8", "--gpu", "h100-sxm", "--tp", "2", "--pp", "2", "--zero", "1"),
        *("--micro-batch", "3", "--grad-accum", "4", "--recompute", "full"),
        *("--offload", "optimizer", "--attention", "eager", "--no-sp"),
        *("--precision", "fp32", "--optimizer", "sgd", "--grad-dtype", "fp32"),
    )
    got = {k: out[k] for k in ("devices", "dp", "tp", "pp", "zero", "sp", "micro_batch")}
    assert got == {"devices": 8, "dp": 2, "tp": 2, "pp": 2, "zero": 1, "sp": False,
                   "micro_batch": 3}  # fmt: skip
    assert (out["grad_accum"], out["recompute"], out["offload"]) == (4, "full", "optimizer")
    assert (out["attention"], out["precision"], out["optimizer"]) == ("eager", "fp32", "sgd")
    assert (out["accelerator"], out["grad_dtype"]) == ("h100-sxm", "fp32")


def test_comm_keeps_its_own_devices_default() -> None:
    """comm's --devices (8 ranks) is its own; the cluster group's (1) must not replace it."""
    out = _json("comm", "--size", "1MB", "--op", "allreduce")
    assert out["cluster"].startswith("8 x ") and out["collectives"][0]["ranks"] == 8


def test_calibration_options_reach_step() -> None:
    a = _json("step", "--model", "gpt2-small", "--devices", "8", "--efficiency", "0.5")
    b = _json("step", "--model", "gpt2-small", "--devices", "8", "--efficiency", "0.25")
    assert a["calibration"]["efficiency"] == 0.5
    # Half the efficiency doubles the compute term (plan.perf: FLOPs / (peak x efficiency)).
    assert b["step"]["compute_s"] == pytest.approx(2 * a["step"]["compute_s"], rel=1e-12)


def test_a_verb_cannot_redeclare_a_shared_option() -> None:
    def verb(opts: PlanOptions, model: str = "x") -> None:
        pass

    with pytest.raises(TypeError, match="model"):
        plan_options(MODEL)(verb)


def test_verbs_offer_the_groups_they_declare() -> None:
    cmd = typer.main.get_command(plan_app)
    flags = {
        name: {o for p in c.params for o in p.opts}
        for name, c in cmd.commands.items()  # type: ignore[attr-defined]
        if name in ("memory", "step", "advise", "comm")
    }
    assert "--per-node" not in flags["memory"] and "--gpus-per-node" not in flags["memory"]
    assert {"--gpus-per-node", "--efficiency", "--largest-layer"} <= flags["step"]
    assert "--tp" not in flags["advise"] and "--kv-heads" not in flags["comm"]


def test_a_verb_with_a_positional_argument_still_parses() -> None:
    """The failure typer issue #1898 reports for signature-rewriting decorators: a command's
    own positional argument lost. Here every parameter is passed by name, so it is kept."""
    verbs = typer.Typer()

    @verbs.command()
    @plan_options(("json_out",))
    def hello(opts: PlanOptions, name: str = typer.Argument(...), count: int = 1) -> None:
        print(f"{name} {count} {opts.json_out}")

    @verbs.command()
    def other() -> None:
        pass

    result = runner.invoke(verbs, ["hello", "Bob", "--json", "--count", "3"])
    assert (result.exit_code, result.output) == (0, "Bob 3 True\n")
