"""The training tracker against a real MLflow SQLite store, read back through MLflow's client.

The engine is not involved: synthetic step records stand in for a training loop.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tests.integration.mlflow_util import fresh_store

from hpcml.config import TrackingConfig, dump_config, flatten, load_config
from hpcml.records import write_json_atomic
from hpcml.track.mlflow import (
    TRACKING_FILE,
    MlflowTracker,
    NullTracker,
    make_tracker,
    reduce_window,
)
from hpcml.track.store import TrackingError, resolve_tracking_uri

pytestmark = pytest.mark.timeout(120)



@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    return fresh_store(tmp_path_factory, "store")


@pytest.fixture(scope="module")
def client(store: str) -> Any:
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=store, registry_uri=store)


def _cfg(store: str, **kw: Any) -> TrackingConfig:
    base: dict[str, Any] = {
        "backend": "mlflow",
        "uri": store,
        "experiment": "unit",
        "log_every": 10,
    }
    return TrackingConfig(**{**base, **kw})


def _steps(first: int, last: int) -> list[dict[str, Any]]:
    return [
        {
            "step": s,
            "loss": 2.0 / s,
            "lr": 0.001 * s,
            "samples_per_s": 1000.0 + s,
            "step_time_s": 0.01,
            "data_wait_s": 0.001,
            "peak_allocated_bytes": 1000 * s,
            "nan_metric": float("nan"),
            "phase": "train",
        }
        for s in range(first, last + 1)
    ]


def _write_run_folder(run_dir: Path, status: str = "finished") -> dict[str, Any]:
    cfg = load_config(None, ["train.max_steps=40"])
    (run_dir / "export").mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    (run_dir / "run.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _steps(1, 40)))
    (run_dir / "export" / "model.json").write_text(json.dumps({"architecture": "mlp"}))
    (run_dir / "export" / "model.safetensors").write_bytes(b"weights")
    summary = {
        "config": cfg.model_dump(mode="json"),
        "world_size": 2,
        "device": {"type": "cpu", "name": "test-cpu", "count": 2},
        "precision": "fp32",
        "model": {"name": "mlp", "parameters": 1234, "forward_flops_per_sample": 99},
        "memory": {
            "0": {"params_bytes": 4936, "peak_allocated_bytes": None},
            "1": {"params_bytes": 1},
        },
        "throughput": {"samples_per_s": 1020.5, "step_time_s": 0.01, "data_wait_s": 0.001},
        "final": {"val_loss": 0.3, "val_accuracy": 0.91, "train_loss": 0.25},
        "steps": 40,
        "status": status,
    }
    write_json_atomic(run_dir / "summary.json", summary)
    return summary


def _history(client: Any, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_reduce_window_means_losses_keeps_last_lr_and_peak_bytes() -> None:
    out = reduce_window(_steps(1, 4))
    assert out["loss"] == pytest.approx((2.0 + 1.0 + 2 / 3 + 0.5) / 4)
    assert out["lr"] == pytest.approx(0.004)
    assert out["peak_allocated_bytes"] == 4000
    assert "nan_metric" not in out and "phase" not in out and "step" not in out


def test_finished_run_has_params_metrics_tags_and_artifacts(
    store: str, client: Any, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    summary = _write_run_folder(run_dir)
    cfg = load_config(None, ["train.max_steps=40"])
    tracker = MlflowTracker(_cfg(store, tags={"team": "vision"}), run_dir)
    tracker.start(flatten(cfg), {"hpcml.config_hash": "abc123"})
    tracker.log_steps(_steps(1, 15))
    tracker.log_steps(_steps(16, 40) + [{"kind": "eval", "step": 40, "val_loss": 9.0}])
    tracker.log_eval({"kind": "eval", "step": 20, "val_loss": 0.5, "val_accuracy": 0.8})
    tracker.log_eval({"kind": "eval", "step": 40, "val_loss": 0.3, "val_accuracy": 0.91})
    tracker.finish(summary, "finished", run_dir)

    state = json.loads((run_dir / TRACKING_FILE).read_text())
    assert state["run_id"] == tracker.run_id and state["tracking_uri"] == store
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "run"
    assert client.get_experiment(run.info.experiment_id).name == "unit"
    assert run.data.params["optim.lr"] == "0.001"
    assert run.data.params["train.max_steps"] == "40"
    assert run.data.params["model.name"] == "simple_cnn"
    assert run.data.tags["team"] == "vision"
    assert run.data.tags["hpcml.config_hash"] == "abc123"
    assert run.data.tags["hpcml.status"] == "finished"
    assert run.data.tags["hpcml.world_size"] == "2"
    assert run.data.tags["hpcml.device.name"] == "test-cpu"

    loss = _history(client, tracker.run_id, "loss")
    assert [s for s, _ in loss] == [10, 20, 30, 40]
    assert loss[0][1] == pytest.approx(sum(2.0 / s for s in range(1, 11)) / 10)
    assert _history(client, tracker.run_id, "lr")[-1] == (40, pytest.approx(0.04))
    assert [s for s, _ in _history(client, tracker.run_id, "samples_per_s")] == [10, 20, 30, 40]
    # The eval record mixed into log_steps is not a step: only log_eval's two points exist.
    assert _history(client, tracker.run_id, "val_accuracy") == [(20, 0.8), (40, 0.91)]
    assert run.data.metrics["final/val_accuracy"] == pytest.approx(0.91)
    assert run.data.metrics["throughput/samples_per_s"] == pytest.approx(1020.5)
    assert run.data.metrics["memory/params_bytes"] == 4936

    top = {a.path for a in client.list_artifacts(tracker.run_id)}
    assert {"summary.json", "config.yaml", "run.jsonl", "export"} <= top
    exported = {a.path for a in client.list_artifacts(tracker.run_id, "export")}
    assert exported == {"export/model.json", "export/model.safetensors"}


def test_partial_window_is_flushed_at_finish(store: str, client: Any, tmp_path: Path) -> None:
    tracker = MlflowTracker(_cfg(store), tmp_path / "partial")
    tracker.start({"a": 1}, {})
    tracker.log_steps(_steps(1, 13))
    tracker.finish({"steps": 13}, "finished", tmp_path / "partial")
    assert [s for s, _ in _history(client, tracker.run_id, "loss")] == [10, 13]


def test_step_points_are_sent_in_time_batches(store: str, client: Any, tmp_path: Path) -> None:
    tracker = MlflowTracker(_cfg(store, flush_every_s=3600), tmp_path / "batched")
    tracker.start({"a": 1}, {})
    tracker.log_steps(_steps(1, 20))  # the first call sends at once: the UI shows the run early
    tracker.log_steps(_steps(21, 40))  # held: the interval has not passed
    tracker._wait()
    assert [s for s, _ in _history(client, tracker.run_id, "loss")] == [10, 20]
    tracker.log_eval({"step": 40, "val_loss": 0.3})  # evaluation sends everything queued
    tracker._wait()
    assert [s for s, _ in _history(client, tracker.run_id, "loss")] == [10, 20, 30, 40]
    tracker.finish({"steps": 40}, "finished", tmp_path / "batched")


@pytest.mark.parametrize(("status", "expected"), [("failed", "FAILED"), ("preempted", "KILLED")])
def test_failed_and_preempted_runs_are_marked(
    store: str, client: Any, tmp_path: Path, status: str, expected: str
) -> None:
    run_dir = tmp_path / status
    summary = _write_run_folder(run_dir, status=status)
    tracker = MlflowTracker(_cfg(store), run_dir)
    tracker.start({"a": 1}, {})
    tracker.log_steps(_steps(1, 10))
    tracker.finish(summary, status, run_dir)
    run = client.get_run(tracker.run_id)
    assert run.info.status == expected
    assert run.data.tags["hpcml.status"] == status
    # Only a finished run ships its model.
    assert "export" not in {a.path for a in client.list_artifacts(tracker.run_id)}


def test_resumed_run_continues_the_same_mlflow_run(store: str, client: Any, tmp_path: Path) -> None:
    run_dir = tmp_path / "resumable"
    first = MlflowTracker(_cfg(store, experiment="resume"), run_dir)
    first.start({"train.max_steps": 40, "optim.lr": 0.001}, {})
    first.log_steps(_steps(1, 20))
    first.finish({"steps": 20}, "preempted", run_dir)
    assert client.get_run(first.run_id).info.status == "KILLED"

    second = MlflowTracker(_cfg(store, experiment="resume"), run_dir)
    second.start({"train.max_steps": 40, "optim.lr": 0.002, "train.new_key": 1}, {})
    assert second.resumed and second.run_id == first.run_id
    assert client.get_run(first.run_id).info.status == "RUNNING"
    second.log_steps(_steps(21, 40))
    second.finish({"steps": 40}, "finished", run_dir)

    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED"
    assert [s for s, _ in _history(client, first.run_id, "loss")] == [10, 20, 30, 40]
    assert run.data.tags["hpcml.resumes"] == "1"
    # Params are write-once in MLflow: the first value stays, the change is recorded as a tag.
    assert run.data.params["optim.lr"] == "0.001"
    assert run.data.params["train.new_key"] == "1"
    assert run.data.tags["hpcml.resume_param.optim.lr"] == "0.002"
    exp = client.get_experiment_by_name("resume")
    assert len(client.search_runs([exp.experiment_id])) == 1


def test_make_tracker_is_null_when_off_or_not_rank_zero(
    store: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert isinstance(make_tracker(TrackingConfig(), tmp_path), NullTracker)
    assert isinstance(make_tracker(_cfg(store), tmp_path), MlflowTracker)
    monkeypatch.setenv("RANK", "1")
    tracker = make_tracker(_cfg(store), tmp_path)
    assert isinstance(tracker, NullTracker)
    tracker.start({}, {})
    tracker.log_steps(_steps(1, 10))
    tracker.finish({}, "finished", tmp_path)
    assert not (tmp_path / TRACKING_FILE).exists()


def test_unusable_store_fails_at_start_with_one_sentence(tmp_path: Path) -> None:
    tracker = MlflowTracker(_cfg(f"sqlite:///{tmp_path}/missing/dir/mlruns.db"), tmp_path)
    with pytest.raises(TrackingError, match="does not exist") as info:
        tracker.start({}, {})
    assert info.value.exit_code == 2


def test_uri_rule_env_then_cwd_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert resolve_tracking_uri(None) == f"sqlite:///{tmp_path.resolve()}/mlruns.db"
    assert resolve_tracking_uri("sqlite:///rel.db") == f"sqlite:///{tmp_path.resolve()}/rel.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking.example:5000")
    assert resolve_tracking_uri(None) == "http://tracking.example:5000"


def test_resume_from_another_folder_continues_the_run_and_another_store_is_refused(
    store: str,
    client: Any,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No tracking.uri and no $MLFLOW_TRACKING_URI: the store is the working folder's
    # mlruns.db. On main a resume from another folder silently began a new MLflow run in that
    # folder's database and overwrote tracking.json.
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    # The first working folder holds a migrated mlruns.db already (migrations take seconds).
    first_cwd = Path(fresh_store(tmp_path_factory, "cwd").removeprefix("sqlite:///")).parent
    other_cwd = tmp_path / "other"
    other_cwd.mkdir()
    run_dir = tmp_path / "run"
    monkeypatch.chdir(first_cwd)
    first = MlflowTracker(_cfg(None, experiment="anywhere"), run_dir)
    first.start({"train.max_steps": 40}, {})
    first.log_steps(_steps(1, 20))
    first.finish({"steps": 20}, "preempted", run_dir)
    recorded = (run_dir / TRACKING_FILE).read_bytes()

    monkeypatch.chdir(other_cwd)
    second = MlflowTracker(_cfg(None, experiment="anywhere"), run_dir)
    second.start({"train.max_steps": 40}, {})
    assert second.resumed and second.run_id == first.run_id
    assert second.uri == f"sqlite:///{first_cwd.resolve()}/mlruns.db"
    second.log_steps(_steps(21, 40))
    second.finish({"steps": 40}, "finished", run_dir)
    assert not (other_cwd / "mlruns.db").exists()
    assert (run_dir / TRACKING_FILE).read_bytes() == recorded

    # Told to track elsewhere (here: the module's store), the resume is refused in one sentence
    # before anything is written.
    third = MlflowTracker(_cfg(store, experiment="anywhere"), run_dir)
    with pytest.raises(TrackingError, match="tracking.uri resolves to") as info:
        third.start({"train.max_steps": 40}, {})
    assert info.value.exit_code == 2 and len(info.value.message.splitlines()) == 1
    assert f"resume with tracking.uri=sqlite:///{first_cwd.resolve()}/mlruns.db" in str(info.value)
    assert (run_dir / TRACKING_FILE).read_bytes() == recorded
    assert client.get_experiment_by_name("anywhere") is None  # nothing created there
    # The same store named explicitly is no change: the run continues.
    fourth = MlflowTracker(_cfg(f"sqlite:///{first_cwd}/mlruns.db", experiment="anywhere"), run_dir)
    fourth.start({"train.max_steps": 40}, {})
    assert fourth.resumed and fourth.run_id == first.run_id
    fourth.finish({"steps": 40}, "finished", run_dir)
