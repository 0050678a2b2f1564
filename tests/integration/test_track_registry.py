"""The model registry on a real MLflow SQLite store: register, list, aliases, the promotion gate
in both directions (library and CLI exit codes), and resolving models:/ URIs to loadable exports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.conftest import hpcml_proc
from tests.integration.mlflow_util import fresh_store

from hpcml.config import TrackingConfig, dump_config, flatten, load_config
from hpcml.models.export import load_export, save_export
from hpcml.models.zoo import build_model
from hpcml.records import write_json_atomic
from hpcml.track.mlflow import TRACKING_FILE, MlflowTracker
from hpcml.track.provenance import collect
from hpcml.track.registry import (
    EXIT_NOT_PROMOTED,
    RegistryError,
    list_versions,
    promote,
    promote_if_better,
    register_run,
)
from hpcml.track.resolve import parse_model_uri, resolve_model_uri

pytestmark = pytest.mark.timeout(180)

SRC = Path(__file__).resolve().parents[2] / "src"
MLP_ARGS = {"input_shape": [1, 8, 8], "hidden": 16, "depth": 1, "num_classes": 10}



@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    return fresh_store(tmp_path_factory, "registry")


@pytest.fixture(scope="module")
def client(store: str) -> Any:
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=store, registry_uri=store)


def make_run(
    run_dir: Path, val_accuracy: float, val_loss: float, status: str = "finished", seed: int = 0
) -> torch.nn.Module:
    """A run folder as `hpcml train` writes it, with a real (tiny) exported model."""
    cfg = load_config(None, ["model.name=mlp", f"train.seed={seed}", "train.max_steps=20"])
    torch.manual_seed(seed)
    model = build_model("mlp", MLP_ARGS)
    final = {"val_loss": val_loss, "val_accuracy": val_accuracy, "train_loss": val_loss - 0.05}
    save_export(
        run_dir / "export",
        model,
        "mlp",
        MLP_ARGS,
        (1, 8, 8),
        (10,),
        metadata={"data": {"source": "digits"}, "run_dir": str(run_dir), "final": final},
    )
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    steps = [{"step": s, "loss": 2.0 / s, "lr": 0.01} for s in range(1, 21)]
    evals = [{"kind": "eval", "step": 20, **{k: final[k] for k in ("val_loss", "val_accuracy")}}]
    (run_dir / "run.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps + evals))
    device = {"type": "cpu", "name": "test-cpu", "count": 1}
    write_json_atomic(
        run_dir / "summary.json",
        {
            "config": cfg.model_dump(mode="json"),
            "world_size": 1,
            "device": device,
            "precision": "fp32",
            "final": final,
            "steps": 20,
            "status": status,
            "provenance": collect(cfg.model_dump(mode="json"), "sha256:data", device),
        },
    )
    return model


def hpcml(*args: str, store: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(SRC), "MLFLOW_TRACKING_URI": store}
    env.pop("RANK", None)
    return hpcml_proc(list(args), env=env, timeout=120)  # forked (tests/conftest.py)


def cli(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str
) -> tuple[int, str, str]:
    """The CLI in this process (fast): `main()` with its real exit-code handling."""
    from hpcml.cli.app import main

    capsys.readouterr()
    monkeypatch.setattr(sys, "argv", ["hpcml", *args])
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_register_untracked_run_logs_it_and_tags_the_version(
    store: str, client: Any, tmp_path: Path
) -> None:
    run_dir = tmp_path / "untracked"
    make_run(run_dir, 0.9, 0.4)
    info = register_run(run_dir, "untracked-model", tracking_uri=store, alias="staging")
    assert info["version"] == 1 and info["aliases"] == ["staging"]
    assert info["metrics"]["val_accuracy"] == pytest.approx(0.9)

    mv = client.get_model_version("untracked-model", "1")
    assert mv.tags["val_accuracy"] == "0.9"
    assert mv.tags["architecture"] == "mlp"
    assert mv.tags["data_fingerprint"] == "sha256:data"
    assert len(mv.tags["config_hash"]) == 64
    assert mv.tags["run_dir"] == str(run_dir.resolve())
    # The run was logged post hoc, with config, steps, summary and export.
    run = client.get_run(mv.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["model.name"] == "mlp"
    assert run.data.tags["hpcml.logged_by"] == "registry register"
    assert [m.step for m in client.get_metric_history(mv.run_id, "loss")] == [10, 20]
    assert run.data.metrics["final/val_accuracy"] == pytest.approx(0.9)
    assert {"export/model.json", "export/model.safetensors"} <= {
        a.path for a in client.list_artifacts(mv.run_id, "export")
    }
    assert json.loads((run_dir / TRACKING_FILE).read_text())["run_id"] == mv.run_id
    # Registering the same folder again links to the same run: no second run appears.
    again = register_run(run_dir, "untracked-model", tracking_uri=store)
    assert again["version"] == 2 and again["run_id"] == mv.run_id


def test_register_tracked_run_links_to_its_training_run(
    store: str, client: Any, tmp_path: Path
) -> None:
    run_dir = tmp_path / "tracked"
    make_run(run_dir, 0.8, 0.5)
    cfg = load_config(None, ["model.name=mlp"])
    tracker = MlflowTracker(TrackingConfig(backend="mlflow", uri=store, experiment="t"), run_dir)
    tracker.start(flatten(cfg), {})
    tracker.log_steps([{"step": s, "loss": 1.0} for s in range(1, 21)])
    summary = json.loads((run_dir / "summary.json").read_text())
    tracker.finish(summary, "finished", run_dir)
    info = register_run(run_dir, "tracked-model", tracking_uri=store)
    assert info["run_id"] == tracker.run_id
    assert info["source"].endswith("/export")
    assert len(client.search_runs([client.get_experiment_by_name("t").experiment_id])) == 1


def test_register_refuses_unfinished_or_exportless_runs(store: str, tmp_path: Path) -> None:
    make_run(tmp_path / "failed", 0.9, 0.4, status="failed")
    with pytest.raises(RegistryError, match="status 'failed'"):
        register_run(tmp_path / "failed", "m", tracking_uri=store)
    (tmp_path / "empty").mkdir()
    with pytest.raises(RegistryError, match="no export/model.json"):
        register_run(tmp_path / "empty", "m", tracking_uri=store)
    with pytest.raises(RegistryError, match="not allowed"):
        register_run(tmp_path / "failed", "bad'name", tracking_uri=store)


def test_aliases_gate_and_resolve(
    store: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = "digits"
    models = {}
    for version, (acc, loss) in enumerate([(0.90, 0.40), (0.85, 0.30), (0.95, 0.35)], start=1):
        models[version] = make_run(tmp_path / f"v{version}", acc, loss, seed=version)
        assert (
            register_run(tmp_path / f"v{version}", name, tracking_uri=store)["version"] == version
        )

    # No production yet: the gate promotes the newest version.
    first = promote_if_better(name, "val_accuracy", version=1, tracking_uri=store)
    assert first.promoted and first.incumbent_version is None
    # Worse accuracy: not promoted, production stays on 1.
    worse = promote_if_better(name, "val_accuracy", version=2, tracking_uri=store)
    assert not worse.promoted and worse.incumbent_version == 1
    assert worse.candidate_value == pytest.approx(0.85)
    # Lower loss is better: the same version 2 passes a val_loss gate (mode chosen by name).
    by_loss = promote_if_better(name, "val_loss", version=2, alias="staging", tracking_uri=store)
    assert by_loss.promoted and by_loss.mode == "min"
    by_loss3 = promote_if_better(name, "val_loss", version=3, alias="staging", tracking_uri=store)
    assert not by_loss3.promoted and by_loss3.incumbent_version == 2
    # Better, but not by the margin asked for.
    narrow = promote_if_better(name, "val_accuracy", min_delta=0.1, tracking_uri=store)
    assert not narrow.promoted and narrow.candidate_version == 3
    # Better: the newest version (3) takes production.
    better = promote_if_better(name, "val_accuracy", tracking_uri=store)
    assert better.promoted and better.candidate_version == 3 and better.incumbent_version == 1
    assert not promote_if_better(name, "val_accuracy", tracking_uri=store).promoted

    rows = {r["version"]: r for r in list_versions(name, tracking_uri=store)}
    assert list(rows) == [3, 2, 1]
    assert rows[3]["aliases"] == ["production"] and rows[2]["aliases"] == ["staging"]
    assert rows[1]["aliases"] == []

    prod = resolve_model_uri(f"models:/{name}@production", tracking_uri=store)
    model, meta = load_export(prod)
    x = torch.randn(4, 1, 8, 8)
    assert torch.equal(model(x), models[3].eval()(x))
    assert meta["metadata"]["final"]["val_accuracy"] == pytest.approx(0.95)
    assert resolve_model_uri(f"models:/{name}/1", tracking_uri=store) != prod
    assert resolve_model_uri(f"models:/{name}/latest", tracking_uri=store) == prod
    assert resolve_model_uri(f"models:/{name}@staging", tracking_uri=store) == resolve_model_uri(
        f"models:/{name}/2", tracking_uri=store
    )

    promote(name, 1, alias="production", tracking_uri=store)
    assert resolve_model_uri(f"models:/{name}@production", tracking_uri=store) == resolve_model_uri(
        f"models:/{name}/1", tracking_uri=store
    )

    # `hpcml serve models:/NAME@production` goes through the same resolution.
    from hpcml.serve.runtime.repository import resolve_model_source

    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    source = resolve_model_source(f"models:/{name}@production")
    v1 = resolve_model_uri(f"models:/{name}/1", tracking_uri=store)
    assert source.kind == "export" and source.models == {name: {"1": v1}}
    assert resolve_model_source(f"models:/{name}/3", name="digits-v3").models == {
        "digits-v3": {"3": prod}
    }


def test_registry_errors_say_what_to_do(store: str, tmp_path: Path) -> None:
    make_run(tmp_path / "r", 0.5, 1.0)
    register_run(tmp_path / "r", "errs", tracking_uri=store)
    with pytest.raises(RegistryError, match="no registered model named 'nope'"):
        list_versions("nope", tracking_uri=store)
    with pytest.raises(RegistryError, match="no version 7"):
        promote("errs", 7, tracking_uri=store)
    with pytest.raises(RegistryError, match="alias 'prod' is not known"):
        promote("errs", 1, alias="prod", tracking_uri=store)
    with pytest.raises(RegistryError, match="no metric 'f1'"):
        promote_if_better("errs", "f1", tracking_uri=store)
    with pytest.raises(RegistryError, match="no alias 'production'"):
        resolve_model_uri("models:/errs@production", tracking_uri=store)
    with pytest.raises(RegistryError, match="not understood"):
        parse_model_uri("runs:/abc/export")
    assert parse_model_uri("models:/a-b.c@staging") == ("a-b.c", "staging", None)
    assert parse_model_uri("models:/a/12") == ("a", None, "12")


def test_cli_register_list_and_gate_exit_codes(
    store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    make_run(tmp_path / "a", 0.70, 0.9, seed=1)
    make_run(tmp_path / "b", 0.60, 1.0, seed=2)
    make_run(tmp_path / "c", 0.75, 0.8, seed=3)
    for d in ("a", "b", "c"):
        code, out, err = cli(
            monkeypatch,
            capsys,
            "registry",
            "register",
            str(tmp_path / d),
            "--name",
            "cli",
            "--json",
        )
        assert code == 0, err
    assert json.loads(out)["version"] == 3
    code, out, _ = cli(
        monkeypatch, capsys, "registry", "promote", "cli", "--version", "1", "--to", "production"
    )
    assert code == 0 and "promoted" in out

    # The gate as CI runs it: a real process, the decision in the exit code.
    gate = ("registry", "promote", "cli", "--if-better", "val_accuracy", "--json")
    worse = hpcml(*gate, "--version", "2", store=store)
    assert worse.returncode == EXIT_NOT_PROMOTED, worse.stderr
    assert json.loads(worse.stdout)["promoted"] is False
    better = hpcml(*gate, store=store)
    assert better.returncode == 0, better.stderr
    assert json.loads(better.stdout)["candidate_version"] == 3

    code, out, _ = cli(monkeypatch, capsys, "registry", "list", "cli", "--json")
    rows = json.loads(out)
    assert [(r["version"], r["aliases"]) for r in rows] == [(3, ["production"]), (2, []), (1, [])]
    code, out, _ = cli(monkeypatch, capsys, "registry", "list", "cli")
    assert code == 0 and "production" in out and "0.75" in out

    code, out, _ = cli(
        monkeypatch, capsys, "registry", "resolve", "models:/cli@production", "--json"
    )
    resolved = json.loads(out)
    assert Path(resolved["path"], "model.json").is_file()
    assert (resolved["version"], resolved["aliases"]) == (3, ["production"])

    code, _, err = cli(
        monkeypatch, capsys, "registry", "promote", "nope", "--if-better", "val_accuracy"
    )
    assert code == 2
    assert "no registered model named 'nope'" in err and "Traceback" not in err
    code, _, err = cli(monkeypatch, capsys, "registry", "promote", "cli")
    assert code == 2 and "--version V" in err


def test_alias_moves_record_who_when_and_why(
    store: str, client: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    from hpcml.track.audit import Attribution, AuditLog, os_user, verify
    from hpcml.track.registry import roll_back_alias

    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    audit = tmp_path / "audit.jsonl"
    monkeypatch.setenv("HPCML_AUDIT_LOG", str(audit))  # the CLI's default --audit-log
    for d, acc in (("a", 0.6), ("b", 0.7)):
        make_run(tmp_path / d, acc, 1 - acc)
        register_run(tmp_path / d, "who", tracking_uri=store)
    code, _, err = cli(monkeypatch, capsys, "registry", "promote", "who", "--version", "1",
                       "--to", "production", "--reason", "first release")  # fmt: skip
    assert code == 0, err
    code, _, err = cli(monkeypatch, capsys, "registry", "promote", "who", "--if-better",
                       "val_accuracy", "--reason", "nightly gate")  # fmt: skip
    assert code == 0, err
    by = Attribution("canary-bot", "p99 over its SLO", AuditLog(audit))
    assert roll_back_alias("who", "production", 2, 1, store, by)

    def moved(version: int) -> dict[str, str]:
        tags = client.get_model_version("who", str(version)).tags
        prefix = "hpcml.alias.production."
        return {k.removeprefix(prefix): v for k, v in tags.items() if k.startswith(prefix)}

    assert moved(2)["moved_by"] == os_user()
    assert moved(2)["reason"] == (
        "nightly gate; gate: val_accuracy 0.7 > 0.6 (version 1)"
    )
    assert (moved(1)["moved_by"], moved(1)["reason"]) == ("canary-bot", "p99 over its SLO")
    assert moved(1)["moved_at"].endswith("Z")
    records = [json.loads(line) for line in audit.read_text().splitlines()]
    assert [(r["actor"], r["action"], r["target"], r["details"]["version"]) for r in records] == [
        (os_user(), "registry.promote", "models:/who@production", "1"),
        (os_user(), "registry.promote", "models:/who@production", "2"),
        ("canary-bot", "canary.rollback", "models:/who@production", "1"),
    ]
    assert records[1]["details"]["previous"] == "1" and verify(audit).intact
