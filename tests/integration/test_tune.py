"""`hpcml tune` end to end: real `hpcml train` trials in subprocesses sharing one study (the
default journal file), pruned from their evaluations, continued by a rerun, surviving kill -9 of the tuner,
planner-infeasible trials never started, and bad input refused with the study unchanged.

The trials train a 16-unit MLP on synthetic data (no scikit-learn import per trial) for at
most 100 steps, so most of a trial is the start of its process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from optuna.storages.journal import JournalFileBackend, JournalStorage
from optuna.trial import TrialState
from tests.conftest import ROOT, hpcml_env, hpcml_proc
from tests.integration.mlflow_util import fresh_store
from typer.testing import CliRunner

from hpcml.cli.app import app

pytestmark = pytest.mark.slow

SPACE_LR = {"type": "float", "low": 1.0e-4, "high": 1.0e-1, "log": True}
WAIT_S = 120.0
"""Bound on waiting for a file a running process writes (fails the test instead of hanging)."""


def tune_config(
    path: Path, tune: dict[str, Any], sections: dict[str, Any] | None = None, **train: Any
) -> Path:
    cfg = {
        "model": {"name": "mlp", "args": {"hidden": 16}},
        "data": {
            "source": "synthetic",
            "synthetic_samples": 256,
            "synthetic_shape": [1, 8, 8],
            "synthetic_classes": 4,
            "batch_size": 16,
        },
        "train": {"max_steps": 100, "eval_every": 5, "log_every": 5, "keep_last": 1,
                  "seed": 0, "device": "cpu", **train},
        "tune": {"metric": "val_loss", "direction": "minimize", "sampler": "random",
                 "space": {"optim.lr": SPACE_LR}, **tune},
        **(sections or {}),
    }  # fmt: skip
    path.write_text(yaml.safe_dump(cfg))
    return path


def tune_cmd(config: Path, out: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "hpcml", "tune", str(config), "--out", str(out), *args]


def run_tune(config: Path, out: Path, *args: str) -> dict[str, Any]:
    proc = hpcml_proc(tune_cmd(config, out, *args, "--json")[3:], timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, proc.stdout  # --json: one line
    return json.loads(lines[0])


def journal(out: Path) -> JournalStorage:
    return JournalStorage(JournalFileBackend(str(out / "study.journal")))


def load(out: Path, name: str = "tune") -> optuna.Study:
    return optuna.load_study(study_name=name, storage=journal(out))


def steps_run(run_dir: Path) -> int:
    recs = [json.loads(line) for line in (run_dir / "run.jsonl").read_text().splitlines()]
    return max(r["step"] for r in recs if r.get("kind") == "step")


def wait_for(what: str, check: Any) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)


def test_two_workers_share_a_tracked_study_prune_register_and_a_rerun_adds_only_new_trials(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
):
    # Seed 28: worker 0 samples lr 0.0154, 0.0048, 0.00024 and worker 1 (seed 29) 0.039,
    # 0.00072, 0.00017, each worker's later trials with a 3x smaller lr than its first. After
    # 5 steps a smaller lr has a higher val_loss, so whatever the timing between the workers,
    # one of them runs two of the 3 trials, and its second meets its own first at ASHA's
    # first rung (step 5), is not the best there, and is pruned 295 steps before its end (the
    # margin lets a tuner slowed by a busy machine answer before the run is over).
    # One study serves the MLflow checks too (a tune and its trials cost seconds of CPU each).
    uri = fresh_store(tmp_path_factory, "tune-mlflow")  # migrated once per session
    tracking = {"tracking": {"backend": "mlflow", "uri": uri, "experiment": "tune-test"}}
    tune = {"pruner": "asha", "trials": 3, "seed": 28}
    config = tune_config(tmp_path / "tune.yaml", tune, tracking, max_steps=300)
    out = tmp_path / "study"
    result = run_tune(config, out, "--workers", "2", "--register", "tune-best")

    n = result["trials"]
    assert n["complete"] + n["pruned"] == 3 and n["failed"] == n["infeasible"] == 0, result
    assert n["pruned"] >= 1, result
    study = load(out)
    trials = study.get_trials()
    assert len(trials) == 3
    # Two workers, one study: trials were run by two processes.
    assert len({t.user_attrs["worker"]["pid"] for t in trials}) == 2
    pruned = [t for t in trials if t.state == TrialState.PRUNED]
    for t in trials:
        run = Path(t.user_attrs["run_dir"])
        assert run == out / "trials" / f"trial-{t.number:04d}"
        # The sampled value reached the run (as the override hpcml tune passed).
        used = yaml.safe_load((run / "config.yaml").read_text())
        assert used["optim"]["lr"] == t.params["optim.lr"]
        record = json.loads((run / "trial.json").read_text())
        assert record["status"] == t.state.name.lower() and record["trial"] == t.number
        # The steps it took, as tune.step_budget counts them (a pruned run's after its stop),
        # and its samples, as tune.sample_budget does: steps x the batch of 16.
        assert t.user_attrs["steps"] == record["steps"] == steps_run(run)
        assert t.user_attrs["samples"] == record["samples"] == 16 * steps_run(run)
        status = json.loads((run / "summary.json").read_text())["status"]
        if t.state == TrialState.COMPLETE:
            assert status == "finished" and steps_run(run) == 300
            assert t.value == json.loads((run / "summary.json").read_text())["final"]["val_loss"]
        else:  # stopped by SIGINT at a step boundary, without a checkpoint for it
            assert status == "interrupted"
    # The pruned trial of the seed argument above stopped long before the end.
    assert min(steps_run(Path(t.user_attrs["run_dir"])) for t in pruned) < 300
    best = min((t for t in trials if t.state == TrialState.COMPLETE), key=lambda t: t.value)
    assert result["best_value"] == best.value and result["best_params"] == best.params
    assert result["best_run"] == best.user_attrs["run_dir"]
    assert 1e-4 <= result["best_params"]["optim.lr"] <= 1e-1
    check_mlflow(uri, load(out), n["pruned"])
    check_registered(uri, load(out), result)

    # The same command with --trials 4 continues the study: exactly one new trial, with a
    # point not tried before, and the finished trials are neither run again nor changed.
    before = {t.number: (t.state, t.value, t.params) for t in trials}
    summaries = {p: p.read_bytes() for p in out.glob("trials/*/summary.json")}
    again = run_tune(config, out, "--workers", "2", "--trials", "4")
    assert again["trials"]["complete"] + again["trials"]["pruned"] == 4
    after = load(out).get_trials()
    assert len(after) == 4
    assert {t.number: (t.state, t.value, t.params) for t in after[:3]} == before
    assert after[3].params["optim.lr"] not in [p["optim.lr"] for _, _, p in before.values()]
    assert all(p.read_bytes() == b for p, b in summaries.items())
    # The rerun's trial nests under the study's one parent run too.
    check_mlflow(uri, load(out), again["trials"]["pruned"])


def check_mlflow(uri: str, study: optuna.Study, pruned: int) -> None:
    """One parent run for the study, FINISHED with the study's numbers, and each trial's own
    training run as its child, with the trial's status, state and sampled optim.lr."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("tune-test")
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if r.data.tags.get("hpcml.tune.study") == "tune"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    parent = parents[0]
    assert parent.data.metrics["best_value"] == study.best_value
    assert parent.data.metrics["trials_pruned"] == pruned
    children = {
        int(r.data.tags["hpcml.tune.trial"]): r
        for r in runs
        if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id
    }
    trials = study.get_trials()
    assert sorted(children) == [t.number for t in trials]
    mlflow_status = {TrialState.COMPLETE: "FINISHED", TrialState.PRUNED: "KILLED"}
    for t in trials:
        child = children[t.number]
        assert child.info.status == mlflow_status[t.state]
        assert child.data.tags["hpcml.tune.state"] == t.state.name.lower()
        assert float(child.data.params["optim.lr"]) == t.params["optim.lr"]
        assert child.data.tags["hpcml.run_dir"] == str(Path(t.user_attrs["run_dir"]).resolve())


def check_registered(uri: str, study: optuna.Study, result: dict[str, Any]) -> None:
    """--register: the best trial's export is version 1 of the model, linked to that trial's
    own training run (its MLflow child), from its run folder."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    best_run = Path(study.best_trial.user_attrs["run_dir"])
    version = client.get_model_version("tune-best", "1")
    assert result["registered"] == {"name": "tune-best", "version": 1, "run_id": version.run_id}
    tags = client.get_run(version.run_id).data.tags
    assert tags["hpcml.run_dir"] == str(best_run.resolve())
    assert tags["hpcml.tune.trial"] == str(study.best_trial.number)


def _running(pid: int) -> bool:
    """Whether `pid` runs (an exited process whose parent is gone is a zombie until reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def test_kill_9_of_the_tuner_then_rerun_retries_the_killed_trial(tmp_path: Path):
    config = tune_config(
        tmp_path / "tune.yaml", {"pruner": "none", "trials": 1}, max_steps=200, eval_every=50
    )
    out = tmp_path / "study"
    killed = out / "trials" / "trial-0000"
    tuner = subprocess.Popen(
        tune_cmd(config, out), cwd=ROOT, env=hpcml_env(),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for("trial 0 to train", lambda: '"step"' in _read(killed / "run.jsonl"))
    finally:
        tuner.kill()  # SIGKILL: nothing of the tuner runs after this
        tuner.wait()
    # The killed tuner's run stops too (its parent-death signal is SIGINT: at a step boundary).
    train_pid = int((killed / "pids" / "rank-0.pid").read_text())
    wait_for("the killed tuner's training to stop", lambda: not _running(train_pid))
    summary = killed / "summary.json"
    assert summary.exists(), (
        f"the run stopped without its summary; run.jsonl ends {_read(killed / 'run.jsonl')[-400:]!r}"
        f", train.log: {_read(killed / 'train.log')[-400:]!r}"
    )
    assert json.loads(summary.read_text())["status"] == "interrupted"
    assert load(out).get_trials()[0].state == TrialState.RUNNING  # as kill -9 left it

    result = run_tune(config, out, "--report")
    assert result["trials"] == {"complete": 1, "pruned": 0, "failed": 0, "infeasible": 0}
    assert result["report"] == str(out / "report" / "index.html")
    assert '<img src="history.png"' in Path(result["report"]).read_text()
    trials = load(out).get_trials()
    assert [t.state for t in trials] == [TrialState.FAIL, TrialState.COMPLETE]
    # The killed trial 0 was failed and run again, with its parameters, as trial 1.
    assert trials[1].system_attrs["failed_trial"] == 0
    assert trials[1].params == trials[0].params
    assert json.loads((killed / "trial.json").read_text())["status"] == "failed"
    assert result["best_run"] == str(out / "trials" / "trial-0001")
    assert steps_run(out / "trials" / "trial-0001") == 200


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


TINY_CATALOG = """\
accelerators:
  tiny-2gb:
    display: a made-up 2 GB device
    memory_bytes: 2.0e9
    memory_bandwidth_bytes_per_s: 1.0e11
    peak_flops: {fp32: 1.0e12}
"""


def test_planner_infeasible_trials_are_recorded_and_never_started(tmp_path: Path):
    (tmp_path / "tiny.yaml").write_text(TINY_CATALOG)
    # Both batch sizes need more than the 0.8 GB the planner leaves usable on the device
    # (tests/unit/test_tune_space.py: a batch of 16 fits).
    space = {"data.batch_size": {"type": "categorical", "choices": [65536, 1000000]}}
    tune = {"sampler": "grid", "trials": 2, "space": space, "device": "tiny-2gb",
            "catalog": [str(tmp_path / "tiny.yaml")]}  # fmt: skip
    config = tune_config(tmp_path / "tune.yaml", tune)
    out = tmp_path / "study"
    result = run_tune(config, out)
    assert result["trials"] == {"complete": 0, "pruned": 0, "failed": 0, "infeasible": 2}
    assert result["best_value"] is None
    assert all("tiny-2gb" in r for r in result["infeasible_reasons"])
    assert not (out / "trials").exists()  # no run folder: no process was started
    trials = load(out).get_trials()
    assert sorted(t.params["data.batch_size"] for t in trials) == [65536, 1000000]
    for t in trials:  # Optuna's constraint: > 0 means infeasible (TPE learns from it)
        assert t.state == TrialState.PRUNED and t.constraints["memory"] > 0


def _cli(*args: str) -> Any:
    return CliRunner().invoke(app, ["tune", *args])


def _existing_study(out: Path) -> bytes:
    """A study.journal holding one finished trial, made with Optuna itself (no training)."""
    out.mkdir(parents=True)
    study = optuna.create_study(study_name="tune", storage=journal(out), direction="minimize")
    study.add_trial(
        optuna.create_trial(
            value=1.0,
            params={"optim.lr": 0.01},
            distributions={"optim.lr": optuna.distributions.FloatDistribution(1e-4, 0.1, log=True)},
        )
    )
    return (out / "study.journal").read_bytes()


@pytest.mark.parametrize(
    ("tune", "args", "words"),
    [
        ({"space": {"optim.lrr": SPACE_LR}}, [], "'optim.lrr'"),
        ({"space": {"optim.lr": {"type": "float", "low": 0.1, "high": 0.01}}}, [], "empty range"),
        ({"space": {"optim.lr": {"type": "gaussian", "low": 0.1, "high": 1}}}, [], "gaussian"),
        ({"device": "tpu-v9"}, [], "tune.device 'tpu-v9'"),
        ({}, ["--workers", "0"], "--workers is 0"),
        ({}, ["--storage", "sqlite:////nonexistent-dir/x/study.db"], "cannot be opened"),
        ({}, ["--storage", "journal:/nonexistent-dir/x/study.journal"], "does not exist"),
        ({"direction": "maximize"}, [], "set to minimize"),
        ({"first_rung": 101}, [], "tune.first_rung 101 is past"),
        ({"step_budget": 99}, [], "tune.step_budget 99 is smaller than one trial"),
        (
            {"sample_budget": 3199},
            ["--nproc", "2"],
            "tune.sample_budget 3199 is smaller than the largest trial (3200 samples",
        ),  # 100 steps x a batch of 16 on each of 2 processes
        ({"seed": -1}, [], "tune.seed"),
        (
            {"metric": "val_f1"},
            [],
            "'val_f1' is not among the metrics an evaluation reports (val_loss, val_accuracy)",
        ),
    ],
)
def test_bad_input_exits_2_in_one_sentence_and_leaves_the_study_unchanged(
    tmp_path: Path, tune: dict[str, Any], args: list[str], words: str
):
    out = tmp_path / "study"
    before = _existing_study(out)
    config = tune_config(tmp_path / "tune.yaml", tune)
    res = _cli(str(config), "--out", str(out), *args)
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) <= 2 and lines[0].startswith("error: ") and "Traceback" not in res.output
    assert words in " ".join(lines), res.output
    assert (out / "study.journal").read_bytes() == before
    assert not (out / "trials").exists()


def test_a_spent_step_budget_starts_no_trial(tmp_path: Path):
    # The study holds a complete trial (100 steps) and a pruned one (30): 130 of a budget of
    # 229 are taken, and a trial of 100 steps no longer fits, whatever --trials says.
    out = tmp_path / "study"
    out.mkdir()
    study = optuna.create_study(study_name="tune", storage=journal(out), direction="minimize")
    dist = {"optim.lr": optuna.distributions.FloatDistribution(1e-4, 0.1, log=True)}
    for state, value, steps in ((TrialState.COMPLETE, 1.0, 100), (TrialState.PRUNED, None, 30)):
        study.add_trial(
            optuna.create_trial(state=state, value=value, params={"optim.lr": 0.01},
                                distributions=dist, intermediate_values={5: 2.0},
                                user_attrs={"steps": steps})
        )  # fmt: skip
    config = tune_config(tmp_path / "tune.yaml", {"step_budget": 229, "trials": 5})
    res = _cli(str(config), "--out", str(out), "--json")
    assert res.exit_code == 0, res.output
    result = json.loads(res.output.splitlines()[-1])
    assert result["trials"] == {"complete": 1, "pruned": 1, "failed": 0, "infeasible": 0}
    assert len(load(out).get_trials()) == 2 and not (out / "trials").exists()


def test_a_worker_process_error_reaches_the_tuner_as_its_sentence(tmp_path: Path):
    # A tune worker beside the tuner (hpcml.tune.study._child, here in a real process) that
    # meets bad input (its config gone since the tuner read it) exits 2 and leaves its
    # sentence in --out; the tuner raises it as its own (printed once, exit 2) and removes it.
    from tests import forked

    from hpcml.errors import HpcmlError
    from hpcml.tune import study as st

    out = tmp_path / "study"
    out.mkdir()
    gone = tmp_path / "gone.yaml"
    job = st.TuneJob(config=gone, overrides=(), out=out, storage="unused", study="tune", trials=1)
    worker = forked.server_context().Process(target=st._child, args=(job, 1, False))
    worker.start()
    worker.join(WAIT_S)
    assert worker.exitcode == 2
    sentence = f"config file {gone} does not exist; pass the path of a YAML config."
    assert json.loads((out / ".worker-1.error").read_text()) == {
        "message": sentence, "exit_code": 2,
    }  # fmt: skip
    with pytest.raises(HpcmlError) as exc:
        st._raise_worker_error(job, [(1, worker.exitcode)])
    assert (exc.value.message, exc.value.exit_code) == (sentence, 2)
    assert not (out / ".worker-1.error").exists()
    # Without its sentence (a worker killed), the tuner says how many failed: exit 1.
    with pytest.raises(HpcmlError) as exc:
        st._raise_worker_error(job, [(1, -9)])
    assert (
        exc.value.exit_code == 1 and "1 tune workers failed (exit codes [-9])" in exc.value.message
    )


def test_without_a_tune_section_exits_2(tmp_path: Path):
    config = tmp_path / "plain.yaml"
    config.write_text("model: {name: mlp}\n")
    res = _cli(str(config), "--out", str(tmp_path / "study"))
    assert res.exit_code == 2 and "has no tune section" in res.output
    assert not (tmp_path / "study").exists()


def _study_with_a_best_rung(out: Path) -> None:
    """A study.journal holding one finished trial that led ASHA's first rung (val_loss 0 at
    step 5), made with Optuna itself: any real trial is pruned at that rung."""
    out.mkdir(parents=True)
    study = optuna.create_study(study_name="tune", storage=journal(out), direction="minimize")
    study.add_trial(
        optuna.create_trial(
            value=0.0,
            params={"optim.lr": 0.01},
            distributions={"optim.lr": optuna.distributions.FloatDistribution(1e-4, 0.1, log=True)},
            intermediate_values={5: 0.0},
            system_attrs={"completed_rung_0": 0.0},  # Optuna's successive halving's own key
        )
    )


def test_a_trial_on_two_processes_is_a_ddp_run_and_pruned_stops_on_both_ranks(tmp_path: Path):
    # --nproc 2, one real trial: the study already holds a trial with val_loss 0 at ASHA's
    # first rung (step 5), so the trial is pruned there: the tuner's SIGINT goes to `hpcml
    # train --nproc 2`, which passes it to torchrun's workers, and both ranks stop at the
    # same step boundary, 145 steps before the end (the margin lets a tuner slowed by a busy
    # machine answer before the run is over).
    config = tune_config(tmp_path / "tune.yaml", {"pruner": "asha", "trials": 2}, max_steps=150)
    out = tmp_path / "study"
    _study_with_a_best_rung(out)
    result = run_tune(config, out, "--nproc", "2")
    assert result["trials"] == {"complete": 1, "pruned": 1, "failed": 0, "infeasible": 0}
    t = load(out).get_trials()[1]
    assert t.state == TrialState.PRUNED
    run = Path(t.user_attrs["run_dir"])
    summary = json.loads((run / "summary.json").read_text())
    assert sorted(p.name for p in (run / "pids").iterdir()) == ["rank-0.pid", "rank-1.pid"]
    assert summary["status"] == "interrupted"
    assert 5 <= steps_run(run) < 150
