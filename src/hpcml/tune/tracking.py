"""A study in MLflow, when the config tracks with `tracking.backend: mlflow`: one parent run
for the study and each trial's own training run as its child.

The parent is made once and its id kept in the Optuna study (`mlflow_parent_run_id`), so
every worker and every later tune of the study nest under it. A trial's `hpcml train` logs
itself as usual (params, the metric curve, its status: FINISHED, KILLED when pruned, FAILED);
the tuner only names its parent (the `mlflow.parentRunId` tag MLflow nests runs by) and adds
the trial's Optuna state as the tag `hpcml.tune.state`. A run stopped after its last
evaluation (the verdict came as it ended) ended KILLED with its training done: the study counts
it complete, and the tuner sets its MLflow status to FINISHED to match. An infeasible trial,
which never trains, gets a child run made by the tuner with its parameters and that tag.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpcml.config import RunConfig
from hpcml.track.mlflow import read_tracking_state
from hpcml.track.store import get_or_create_experiment, open_client, stringify

PARENT_ATTR = "mlflow_parent_run_id"
STATE_TAG = "hpcml.tune.state"


def enabled(cfg: RunConfig) -> bool:
    return cfg.tracking.backend == "mlflow"


def open_parent(cfg: RunConfig, study: Any, storage: str) -> str:
    """The study's parent run (made on the first tune), marked RUNNING for this tune."""
    client, uri = open_client(cfg.tracking.uri)
    known = study.user_attrs.get(PARENT_ATTR)
    if known:
        client.update_run(known, status="RUNNING")
        return str(known)
    tune = cfg.tune
    assert tune is not None
    experiment_id = get_or_create_experiment(client, uri, cfg.tracking.experiment)
    tags = {
        **cfg.tracking.tags,
        "hpcml.tune.study": study.study_name,
        "hpcml.tune.storage": storage,
        "hpcml.tune.metric": tune.metric,
        "hpcml.tune.direction": tune.direction,
    }
    run = client.create_run(experiment_id, run_name=f"tune-{study.study_name}", tags=tags)
    for key, param in tune.space.items():
        client.log_param(run.info.run_id, f"space.{key}", stringify(param.model_dump(), 500))
    study.set_user_attr(PARENT_ATTR, run.info.run_id)
    return str(run.info.run_id)


def trial_overrides(cfg: RunConfig, study: Any, number: int) -> list[str]:
    """`hpcml train` overrides that make the trial's MLflow run a child of the study's."""
    from hpcml.tune.space import override

    parent = study.user_attrs[PARENT_ATTR]
    tags = {**cfg.tracking.tags, "mlflow.parentRunId": parent, "hpcml.tune.trial": str(number)}
    return [
        override("tracking.tags", tags),
        override("tracking.run_name", f"{study.study_name}-trial-{number:04d}"),
    ]


def record_trial(
    cfg: RunConfig, study: Any, number: int, state: str, run_dir: Path | None, params: dict
) -> None:
    """Tag the trial's run with its Optuna state (a child run is made for one never run)."""
    client, uri = open_client(cfg.tracking.uri)
    tracked = read_tracking_state(run_dir) if run_dir is not None else None
    if tracked is not None:
        run_id = tracked["run_id"]
        client.set_tag(run_id, STATE_TAG, state)
        if state == "complete" and client.get_run(run_id).info.status != "FINISHED":
            # Stopped by a verdict that came after its last evaluation, the run ended KILLED
            # with all its training done; the study counts it complete, and so does MLflow.
            client.set_tag(run_id, "hpcml.tune.note", "stopped after its last evaluation")
            client.set_terminated(run_id, status="FINISHED")
        return
    experiment_id = get_or_create_experiment(client, uri, cfg.tracking.experiment)
    tags = {
        "mlflow.parentRunId": study.user_attrs[PARENT_ATTR],
        "hpcml.tune.trial": str(number),
        STATE_TAG: state,
    }
    run = client.create_run(
        experiment_id, run_name=f"{study.study_name}-trial-{number:04d}", tags=tags
    )
    for key, value in params.items():
        client.log_param(run.info.run_id, key, stringify(value, 500))
    client.set_terminated(run.info.run_id, status="KILLED")


def close_parent(cfg: RunConfig, study: Any, result: dict[str, Any]) -> None:
    """The study's numbers on the parent run, which ends FINISHED for this tune."""
    parent = study.user_attrs.get(PARENT_ATTR)
    if not parent:
        return
    client, _ = open_client(cfg.tracking.uri)
    for state, count in result["trials"].items():
        client.log_metric(parent, f"trials_{state}", count)
    if result["best_value"] is not None:
        client.log_metric(parent, "best_value", result["best_value"])
        client.set_tag(parent, "hpcml.tune.best_run", str(result["best_run"]))
        client.set_tag(parent, "hpcml.tune.best_params", stringify(result["best_params"], 5000))
    client.set_terminated(parent, status="FINISHED")
