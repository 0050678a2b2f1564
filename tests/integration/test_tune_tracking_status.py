"""A trial's MLflow run says what the study says: a run that `hpcml train` ended KILLED after
its last evaluation (the tuner's verdict came as it ended) is complete in the study, so the
tuner marks its run FINISHED; a pruned trial's KILLED run stays KILLED. A real MLflow SQLite
store; the runs are made as `hpcml train` makes them (a child of the study's parent, its id in
the run folder's tracking.json)."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest
from tests.integration.mlflow_util import fresh_store

from hpcml.config import build_config
from hpcml.track.mlflow import TRACKING_FILE
from hpcml.track.store import open_client
from hpcml.tune import tracking


@pytest.mark.parametrize(
    ("state", "status"), [("complete", "FINISHED"), ("pruned", "KILLED")]
)  # fmt: skip
def test_a_complete_trial_whose_run_ended_killed_is_finished_in_mlflow(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, state: str, status: str
) -> None:
    uri = fresh_store(tmp_path_factory, "tune-status")
    cfg = build_config(
        {"model": {"name": "mlp"}, "data": {"source": "synthetic"},
         "tracking": {"backend": "mlflow", "uri": uri}},
        origin="test",
    )  # fmt: skip
    study = optuna.create_study(direction="maximize")
    client, _ = open_client(uri)
    experiment = client.create_experiment("tune")
    parent = client.create_run(experiment).info.run_id
    study.set_user_attr(tracking.PARENT_ATTR, parent)
    child = client.create_run(experiment, tags={"mlflow.parentRunId": parent}).info.run_id
    client.set_terminated(child, status="KILLED")  # what the interrupted run wrote
    (tmp_path / TRACKING_FILE).write_text(json.dumps({"run_id": child}))

    tracking.record_trial(cfg, study, 0, state, tmp_path, {"optim.lr": 0.01})

    run = client.get_run(child)
    assert run.info.status == status
    assert run.data.tags[tracking.STATE_TAG] == state
