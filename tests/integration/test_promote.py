"""`hpcml promote` on a real MLflow SQLite store with real models scored on the digits' held-out
split: the first candidate is promoted on its gates, a better one replaces it (McNemar and the
bootstrap agree), a copy of the holder is refused with exit 3 and its version records why,
a failed gate refuses, and bad input is exit 2 with nothing registered."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tests.conftest import hpcml_env, run_hpcml
from tests.integration.mlflow_util import fresh_store

from hpcml.config import dump_config, load_config
from hpcml.data.sources import load_source
from hpcml.models.export import save_export
from hpcml.models.zoo import build_model
from hpcml.records import write_json_atomic

pytestmark = pytest.mark.timeout(240)

ARGS = {"input_shape": [3, 32, 32], "hidden": 32, "depth": 1, "num_classes": 10}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    return fresh_store(tmp_path_factory, "promote")


def trained(steps: int, seed: int = 0) -> torch.nn.Module:
    """An MLP trained `steps` Adam steps on the digits' training split (0: as initialized)."""
    splits = load_source(load_config(None).data)
    x, y = splits.train.tensors  # type: ignore[attr-defined]
    torch.manual_seed(seed)
    model = build_model("mlp", ARGS)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, len(y), (64,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    return model.eval()


def run_folder(run_dir: Path, model: torch.nn.Module) -> Path:
    """A finished run folder as `hpcml train` leaves it: summary.json and export/."""
    cfg = load_config(None, ["model.name=mlp"])
    save_export(run_dir / "export", model, "mlp", ARGS, (3, 32, 32), (10,),
                metadata={"data": {"source": "digits"}})  # fmt: skip
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    write_json_atomic(
        run_dir / "summary.json",
        {"config": cfg.model_dump(mode="json"), "world_size": 1, "status": "finished",
         "device": {"type": "cpu", "name": "cpu", "count": 1}, "precision": "fp32",
         "final": {"val_accuracy": 0.0}, "steps": 1},
    )  # fmt: skip
    return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("promote-runs")
    weak = trained(3)
    return {
        "weak": run_folder(root / "weak", weak),
        "weak-copy": run_folder(root / "weak-copy", weak),
        "good": run_folder(root / "good", trained(150)),
    }


def promote(store: str, *args: str) -> tuple[int, dict[str, Any], str]:
    proc = run_hpcml("promote", *args, "--json", env=hpcml_env(MLFLOW_TRACKING_URI=store),
                     check=False)  # fmt: skip
    out = json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else {}
    return proc.returncode, out, proc.stderr


def holder(store: str, name: str, alias: str = "production") -> int | None:
    from mlflow import MlflowClient

    return MlflowClient(store, store).get_registered_model(name).aliases.get(alias)


def version_tags(store: str, name: str, version: int) -> dict[str, str]:
    from mlflow import MlflowClient

    return MlflowClient(store, store).get_model_version(name, str(version)).tags


def test_first_promoted_then_better_then_refused(store: str, runs: dict[str, Path]) -> None:
    code, out, err = promote(store, str(runs["weak"]), "--model", "digits")
    assert code == 0, err
    assert out["incumbent_version"] is None and out["candidate_version"] == 1
    assert holder(store, "digits") == 1, out

    code, out, err = promote(store, str(runs["good"]), "--model", "digits")
    assert code == 0, err
    c = out["comparison"]
    assert c["samples"] == 359  # the digits' held-out split (20% of 1,797), by both models
    assert c["candidate"] > c["incumbent"] + 0.2
    assert c["p_value"] < 1e-6 and c["ci_low"] > 0
    assert holder(store, "digits") == 2
    tags = version_tags(store, "digits", 2)
    assert tags["hpcml.promote.decision"] == "promoted"
    assert tags["hpcml.promote.incumbent_version"] == "1"
    assert float(tags["hpcml.promote.p_value"]) == pytest.approx(c["p_value"])

    # The weak model again, now against the good one: refused, recorded, alias untouched.
    code, out, err = promote(store, str(runs["weak-copy"]), "--model", "digits")
    assert code == 3, err
    assert not out["promoted"] and out["comparison"]["gain"] < 0
    assert holder(store, "digits") == 2
    tags = version_tags(store, "digits", out["candidate_version"])
    assert tags["hpcml.promote.decision"] == "refused"
    assert "does not show a gain" in tags["hpcml.promote.reason"]


def test_failed_gates_refuse_even_the_first(store: str, runs: dict[str, Path]) -> None:
    """The size gate, and the latency gate: a real `hpcml serve` of the candidate driven by
    `hpcml loadtest`'s generator (2 s at 20/s); 1 us is below any real p99."""
    code, out, err = promote(
        store, str(runs["good"]), "--model", "gated", "--max-size-mb", "0.001",
        "--latency-budget-ms", "0.001", "--latency-duration", "2",
    )  # fmt: skip
    assert code == 3, err
    assert out["gates"]["size"]["passed"] is False and out["gates"]["smoke"]["passed"]
    lat = out["gates"]["latency"]
    assert lat["ok"] >= 30 and lat["errors"] == 0  # it served every request
    assert lat["p99_ms"] > 0.001 and not lat["passed"]
    assert out["reason"] == "gate(s) failed: size, latency"
    assert holder(store, "gated") is None


def test_bad_input_is_exit_2_and_registers_nothing(store: str, runs: dict[str, Path]) -> None:
    code, _, err = promote(store, str(runs["good"]), "--model", "bad", "--confidence", "1.5")
    assert code == 2 and "--confidence" in err and "Traceback" not in err
    code, _, err = promote(store, str(runs["good"].parent / "missing"), "--model", "bad")
    assert code == 2 and "not a finished hpcml run folder" in err
    from mlflow import MlflowClient

    assert not MlflowClient(store, store).search_registered_models("name = 'bad'")
