"""hpcml.tune's pruning on Optuna's own study, without running a trial: a trial queued again
after its worker died is judged from its first rung, as a new trial is, and the pruners' rungs
fall where the trials are evaluated, before their end."""

from __future__ import annotations

import os
import time
from pathlib import Path

import optuna
import pytest
from optuna.distributions import FloatDistribution, IntDistribution
from optuna.trial import TrialState, create_trial
from pydantic import ValidationError

from hpcml.config import TuneConfig, load_config
from hpcml.tune import budget
from hpcml.tune import storage as st
from hpcml.tune.study import make_pruner

LR = {"optim.lr": FloatDistribution(1e-4, 1e-1, log=True)}


def _study_at_rung_0(url: str, pruner: optuna.pruners.BasePruner | None = None) -> optuna.Study:
    """A study whose ASHA (rungs at steps 20 and 60) holds three finished trials at rung 0."""
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    study = optuna.create_study(
        study_name="s", storage=st.open_storage(url), direction="maximize",
        pruner=pruner or optuna.pruners.SuccessiveHalvingPruner(min_resource=20,
                                                                 reduction_factor=3),
    )  # fmt: skip
    for i, value in enumerate((0.90, 0.91, 0.92)):
        study.add_trial(
            create_trial(value=value, params={"optim.lr": 10.0 ** (-2 - i)}, distributions=LR,
                         intermediate_values={20: value}, system_attrs={"completed_rung_0": value})
        )  # fmt: skip
    return study


@pytest.mark.parametrize("kind", ["journal", "sqlite"])
def test_a_retried_trial_is_judged_from_the_first_rung_and_starts_clean(
    tmp_path: Path, kind: str
) -> None:
    """Optuna's retry copies the dead attempt's system attributes: with its `completed_rung_0`
    the retry's first verdict was taken at rung 1 (step 60), so it passed rung 0 whatever it
    scored there. Its stale `heartbeat` made a retry on another host look dead before its own
    first beat. Both storages' paths: the tuner's dead-worker check (either storage) and the
    RDB storage's own heartbeat callback."""
    url = st.default_storage(tmp_path) if kind == "journal" else f"sqlite:///{tmp_path}/s.db"
    study = _study_at_rung_0(url)
    dead = study.ask(LR)
    dead.report(0.95, 20)
    assert not dead.should_prune()  # the best at rung 0: promoted, completed_rung_0 is set
    dead.set_user_attr("heartbeat", time.time() - st.GRACE_S - 5)
    # Its worker: this host, a pid whose start time is not the recorded one (it is gone).
    dead.set_user_attr("worker", {"host": os.uname().nodename, "pid": os.getpid(), "started": "0"})
    dead.set_user_attr("run_dir", str(tmp_path / "trial-0003"))
    st.fail_dead_trials(study)
    assert study.get_trials()[dead.number].state == TrialState.FAIL
    retry = study.ask()  # the queued retry, same parameters
    frozen = study._storage.get_trial(retry._trial_id)
    assert frozen.params == dead.params
    assert optuna.storages.RetryHeartbeatStaleTrialCallback.retry_history(frozen) == [dead.number]
    assert not [k for k in frozen.system_attrs if k.startswith("completed_rung_")]
    assert not {"heartbeat", "worker", "run_dir"} & set(frozen.user_attrs)
    retry.report(0.10, 20)  # far worse than every trial at rung 0 this time
    assert retry.should_prune()
    study.tell(retry, state=TrialState.PRUNED)

    # The RDB storage's heartbeat queues a stale trial through the callback open_storage gave it.
    if kind == "sqlite":
        storage = study._storage  # the RDBStorage open_storage made, behind Optuna's cache
        again = study.ask(LR)
        again.report(0.99, 20)
        assert not again.should_prune()
        storage.set_trial_state_values(again._trial_id, TrialState.FAIL)
        callback = storage.get_heartbeat_stale_trial_callback()  # type: ignore[attr-defined]
        callback(study, storage.get_trial(again._trial_id))
        queued = study.get_trials(states=(TrialState.WAITING,))
        assert len(queued) == 1 and queued[0].params == again.params
        assert "completed_rung_0" not in queued[0].system_attrs


@pytest.mark.parametrize("kind", ["journal", "sqlite"])
def test_a_retry_does_not_compete_with_its_own_dead_attempt(tmp_path: Path, kind: str) -> None:
    """The dead attempt keeps the rung value it reported (0.95, the best at rung 0): with it
    among the competitors the retry's 0.93 is second of five, outside the top third, and was
    pruned; without it, 0.93 is the best of four and goes on. hpcml's asha pruner, on both
    storages, the attempt failed and queued again by the tuner's dead-worker check."""
    url = st.default_storage(tmp_path) if kind == "journal" else f"sqlite:///{tmp_path}/s.db"
    cfg = load_config(None, ["train.eval_every=20", "train.max_steps=180"])
    pruner = make_pruner(TuneConfig(pruner="asha", reduction_factor=3), cfg, {})
    study = _study_at_rung_0(url, pruner)
    dead = study.ask(LR)
    dead.report(0.95, 20)
    assert not dead.should_prune()
    dead.set_user_attr("worker", {"host": os.uname().nodename, "pid": os.getpid(), "started": "0"})
    st.fail_dead_trials(study)
    retry = study.ask()
    assert optuna.storages.RetryHeartbeatStaleTrialCallback.retry_history(
        study._storage.get_trial(retry._trial_id)
    ) == [dead.number]
    retry.report(0.93, 20)
    assert not retry.should_prune()
    # A new trial still competes with every live trial, the retry's 0.93 among them: 0.915 is
    # third of five, outside the top third (5 // 3 = 1).
    other = study.ask(LR)
    other.report(0.915, 20)
    assert other.should_prune()


def test_the_rungs_act_at_evaluations_before_the_end() -> None:
    """asha's and hyperband's reduction factor: 3, unless 3 leaves one rung that acts before
    the longest trial's end and 2 leaves more (the digits example: rungs 20 and 60, the end,
    with 3; 20 and 40 with 2); `tune.reduction_factor` as given."""
    warmup = {"optim.warmup_steps": IntDistribution(0, 10, step=5)}
    digits = load_config(None, ["train.eval_every=20", "train.max_steps=60"])
    for name in ("asha", "hyperband"):
        made = make_pruner(TuneConfig(pruner=name), digits, warmup)  # type: ignore[arg-type]
        pruner = getattr(made, "inner", made)  # asha: behind WithoutRetriedAttempts
        assert (pruner._min_resource, pruner._reduction_factor) == (20, 2), name  # type: ignore[attr-defined]
    # Rungs act at the evaluation at or after their step: evaluated at 40 and 60 only, 2's
    # rungs at 20 and 40 both act at 40, so 2 gains nothing and 3 stays.
    sparse = load_config(None, ["train.eval_every=40", "train.max_steps=60"])
    assert budget.reduction_factor(TuneConfig(first_rung=20), sparse, {}) == 3
    # Long trials have several rungs before the end with 3: it stays.
    long = load_config(None, ["train.eval_every=25", "train.max_steps=400"])
    assert budget.reduction_factor(TuneConfig(), long, {}) == 3
    assert budget.reduction_factor(TuneConfig(reduction_factor=4), digits, warmup) == 4
    with pytest.raises(ValidationError):
        TuneConfig(reduction_factor=1)
