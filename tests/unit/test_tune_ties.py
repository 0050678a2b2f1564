"""The tune summary's standard error of the best accuracy and the trials tied with it
(hpcml.tune.report.ties), on an in-memory Optuna study whose values are chosen around the
error's edge: best 0.9 scored on 100 samples has one binomial standard error of exactly 0.03."""

from __future__ import annotations

import optuna
import pytest
from optuna.distributions import FloatDistribution
from optuna.trial import TrialState, create_trial

from hpcml.tune.report import EVAL_SAMPLES_ATTR, summary

DIST = {"x": FloatDistribution(0.0, 1.0)}


def study_of(values: list[tuple[float, TrialState]], n: int | None) -> optuna.Study:
    study = optuna.create_study(direction="maximize")
    for i, (value, state) in enumerate(values):
        attrs = {} if n is None else {EVAL_SAMPLES_ATTR: n}
        complete = state == TrialState.COMPLETE
        study.add_trial(create_trial(
            params={"x": i / 10}, distributions=DIST, user_attrs=attrs, state=state,
            value=value if complete else None,
            intermediate_values={} if complete else {20: value},
        ))  # fmt: skip
    return study


def test_trials_within_one_standard_error_of_the_best_are_tied_with_it() -> None:
    study = study_of(
        [
            (0.5, TrialState.COMPLETE),  # 0: far below
            (0.871, TrialState.COMPLETE),  # 1: 0.029 below, inside
            (0.9, TrialState.COMPLETE),  # 2: the best
            (0.869, TrialState.COMPLETE),  # 3: 0.031 below, outside
            (0.95, TrialState.PRUNED),  # 4: pruned: not a result, whatever its rung said
            (0.895, TrialState.COMPLETE),  # 5: 0.005 below, the closest
        ],
        n=100,
    )
    out = summary(study, "memory", "val_accuracy")
    assert out["best_trial"] == 2
    assert out["best_standard_error"] == pytest.approx(0.03, rel=1e-12)  # sqrt(.9 * .1 / 100)
    assert out["best_scored_on"] == 100
    assert out["tied_with_best"] == [5, 1]  # closest first


def test_a_loss_or_an_accuracy_without_its_sample_count_gets_no_error() -> None:
    """A loss has no binomial error; an accuracy whose run did not count its samples (a named
    eval set's) cannot have one."""
    values = [(0.9, TrialState.COMPLETE), (0.89, TrialState.COMPLETE)]
    assert summary(study_of(values, 100), "m", "val_accuracy")["tied_with_best"] == [1]
    for metric, n in (("val_loss", 100), ("holdout/val_accuracy", None)):
        out = summary(study_of(values, n), "m", metric)
        assert "best_standard_error" not in out and "tied_with_best" not in out, (metric, n)
