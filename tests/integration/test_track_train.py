"""`hpcml train` with tracking on, end to end: MLflow's own client sees the params, metrics,
provenance tags and artifacts; a crashed run is FAILED; resuming it continues the same MLflow
run; the finished run registers and resolves to a loadable model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from tests.integration.mlflow_util import fresh_store

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "digits_cnn.yaml"

# A user model (import path) that raises in its Nth training forward when asked to: a real
# crash inside the training loop, after a checkpoint, without touching the engine.
CRASHY_MODEL = """
import os
from torch import nn

class Crashy(nn.Module):
    def __init__(self, num_classes=10, in_channels=3):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(in_channels * 32 * 32, num_classes))
        self.calls = 0

    def forward(self, x):
        if self.training:
            self.calls += 1
            if self.calls == int(os.environ.get("CRASH_AT_FORWARD", "0")):
                raise RuntimeError("injected crash")
        return self.net(x)

def build(num_classes=10, in_channels=3):
    return Crashy(num_classes, in_channels)
"""



@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    return fresh_store(tmp_path_factory, "train-store")


@pytest.fixture(scope="module")
def client(store: str) -> Any:
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=store, registry_uri=store)


def _clean_env() -> dict[str, str]:
    # A test process inside torchrun must not make the child think it is a worker.
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}


def train(
    *args: str,
    store: str | None,
    cwd: Path,
    extra_path: Path | None = None,
    env: dict | None = None,
) -> subprocess.CompletedProcess[str]:
    """`hpcml train ... tracking.backend=mlflow` in `cwd`; `store=None` leaves tracking.uri unset
    (and $MLFLOW_TRACKING_URI too): the default store is then relative to the working folder."""
    path = os.pathsep.join(str(p) for p in (ROOT / "src", extra_path) if p is not None)
    uri = [] if store is None else [f"tracking.uri={store}"]
    clean = {k: v for k, v in _clean_env().items() if k != "MLFLOW_TRACKING_URI"}
    return subprocess.run(
        [sys.executable, "-m", "hpcml", "train", *args, "tracking.backend=mlflow", *uri, "--quiet"],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**clean, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **(env or {})},
        timeout=400,
    )


def test_train_run_is_tracked_and_registrable(store: str, client: Any, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    out = train(
        str(EXAMPLE), "train.max_steps=20", "train.eval_every=10", "train.checkpoint_every=0",
        "tracking.experiment=e2e", "tracking.tags.team=vision", "--run-dir", str(run_dir),
        store=store, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    run_id = json.loads((run_dir / "tracking.json").read_text())["run_id"]

    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "e2e"
    assert run.data.params["optim.lr"] == "0.002"
    assert run.data.params["train.max_steps"] == "20"
    assert run.data.params["model.name"] == "simple_cnn"
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [10, 20]
    assert [m.step for m in client.get_metric_history(run_id, "val_accuracy")] == [10, 20]
    assert run.data.metrics["final/val_accuracy"] == pytest.approx(summary["final"]["val_accuracy"])
    assert run.data.metrics["memory/model_states_bytes"] > 0
    assert run.data.metrics["samples_per_s"] > 0
    # Step records carry the process's resident set, and MLflow gets each window's max of it.
    rss = {
        r["step"]: r["rss_bytes"]
        for r in map(json.loads, (run_dir / "run.jsonl").read_text().splitlines())
        if r.get("kind") == "step"
    }
    assert sorted(rss) == list(range(1, 21))
    # The process has imported torch (well over 64 MiB resident on its own); no step exceeds
    # the peak the summary reports for the whole process, give or take 32 MiB: the kernel's
    # RSS counters are per-CPU sums read without a lock, a few MB apart at any moment. What
    # this bounds out is a wrong figure, e.g. the virtual size (gigabytes with torch loaded).
    peak = summary["memory"]["peak_rss_bytes"]
    assert all(64 << 20 < v <= peak + (32 << 20) for v in rss.values())
    history = client.get_metric_history(run_id, "rss_bytes")
    assert [(m.step, m.value) for m in history] == [
        (10, max(rss[s] for s in range(1, 11))),
        (20, max(rss[s] for s in range(11, 21))),
    ]

    prov = summary["provenance"]
    assert run.data.tags["team"] == "vision"
    assert run.data.tags["hpcml.config_hash"] == prov["config_hash"]
    assert run.data.tags["hpcml.data_fingerprint"] == summary["data"]["fingerprint"]
    assert run.data.tags["hpcml.version.torch"] == prov["packages"]["torch"]
    assert run.data.tags["hpcml.world_size"] == "1"
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"summary.json", "config.yaml", "run.jsonl", "export"} <= artifacts

    from hpcml.models.export import load_export
    from hpcml.track.registry import register_run
    from hpcml.track.resolve import resolve_model_uri

    info = register_run(run_dir, "digits-e2e", tracking_uri=store, alias="production")
    assert info["run_id"] == run_id
    assert info["metrics"]["val_accuracy"] == pytest.approx(summary["final"]["val_accuracy"])
    assert info["tags"]["config_hash"] == prov["config_hash"]
    model, meta = load_export(resolve_model_uri("models:/digits-e2e@production", store))
    assert meta["architecture"] == "simple_cnn"


def test_crashed_run_is_failed_and_resume_continues_it(
    store: str, client: Any, tmp_path: Path
) -> None:
    (tmp_path / "crashmod.py").write_text(CRASHY_MODEL)
    run_dir = tmp_path / "crashy"
    args = (
        str(EXAMPLE), "model.name=crashmod:build", "train.max_steps=10", "train.eval_every=0",
        "train.checkpoint_every=5", "train.log_every=5", "tracking.log_every=5", "tracking.experiment=crash",
        "--run-dir", str(run_dir),
    )  # fmt: skip
    crashed = train(
        *args, store=store, cwd=tmp_path, extra_path=tmp_path, env={"CRASH_AT_FORWARD": "8"}
    )
    assert crashed.returncode != 0
    assert "injected crash" in crashed.stderr
    run_id = json.loads((run_dir / "tracking.json").read_text())["run_id"]
    run = client.get_run(run_id)
    assert run.info.status == "FAILED"
    assert "injected crash" in run.data.tags["hpcml.error"]
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [5]
    # The failed run's summary keeps its provenance (on main it had status and error only).
    failed = json.loads((run_dir / "summary.json").read_text())
    assert failed["status"] == "failed"
    assert failed["provenance"]["config_hash"] == run.data.tags["hpcml.config_hash"]
    assert failed["provenance"]["data_fingerprint"] == run.data.tags["hpcml.data_fingerprint"]

    # Resumed into another store: refused in one sentence before anything is written (on main
    # it began a second MLflow run there and overwrote tracking.json).
    files = {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}
    elsewhere = f"sqlite:///{tmp_path}/elsewhere.db"
    refused = train(*args, "--resume", "auto", store=elsewhere, cwd=tmp_path, extra_path=tmp_path)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert refused.stderr.strip().splitlines() == [
        f"error: run folder {run_dir} is tracked in MLflow run {run_id} of {store} "
        f"(tracking.json), but tracking.uri resolves to {elsewhere}; resume with "
        f"tracking.uri={store} (or leave it unset), or train into a new run folder to start a "
        "new MLflow run."
    ]
    assert {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()} == files
    assert not (tmp_path / "elsewhere.db").exists()

    # Resumed from another working folder with tracking.uri unset: the store and run that
    # tracking.json records, not a new run in that folder's default store (main started one
    # in <cwd>/mlruns.db and overwrote tracking.json).
    other_cwd = tmp_path / "other-cwd"
    other_cwd.mkdir()
    resumed = train(*args, "--resume", "auto", store=None, cwd=other_cwd, extra_path=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert list(other_cwd.iterdir()) == []
    assert json.loads((run_dir / "tracking.json").read_text())["run_id"] == run_id
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["hpcml.resumes"] == "1"
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [5, 10]
    assert len(client.search_runs([run.info.experiment_id])) == 1

    # --overwrite starts again: a new MLflow run, the old one kept as it was.
    again = train(*args, "--overwrite", store=store, cwd=tmp_path, extra_path=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    new_id = json.loads((run_dir / "tracking.json").read_text())["run_id"]
    assert new_id != run_id
    assert client.get_run(run_id).info.status == "FINISHED"
