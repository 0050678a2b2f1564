"""What a study holds, as `hpcml tune` prints it: trial counts by outcome and the best trial.

A failed trial that was queued again (its worker died) is not counted: its retry is.
"""

from __future__ import annotations

from typing import Any

import optuna
from optuna.storages import RetryHeartbeatStaleTrialCallback
from optuna.trial import FrozenTrial, TrialState


def retried_numbers(trials: list[FrozenTrial]) -> set[int]:
    return {n for t in trials for n in RetryHeartbeatStaleTrialCallback.retry_history(t)}


def counts(trials: list[FrozenTrial]) -> dict[str, int]:
    """complete / pruned / failed / infeasible / running; a failed trial queued again is not
    counted (its retry is)."""
    retried = retried_numbers(trials)
    out = dict.fromkeys(("complete", "pruned", "failed", "infeasible", "running"), 0)
    for t in trials:
        if t.state == TrialState.COMPLETE:
            out["complete"] += 1
        elif t.state == TrialState.PRUNED:
            out["infeasible" if "infeasible" in t.user_attrs else "pruned"] += 1
        elif t.state == TrialState.FAIL and t.number not in retried:
            out["failed"] += 1
        elif t.state == TrialState.RUNNING:
            out["running"] += 1
    return out


def summary(study: optuna.Study, storage: str) -> dict[str, Any]:
    """The study as `hpcml tune --json` prints it."""
    trials = study.get_trials(deepcopy=False)
    n = counts(trials)
    out: dict[str, Any] = {
        "study": study.study_name,
        "storage": storage,
        "best_value": None,
        "best_params": None,
        "best_run": None,
        "trials": {k: n[k] for k in ("complete", "pruned", "failed", "infeasible")},
    }
    if n["complete"]:
        best = study.best_trial
        out.update(
            best_value=best.value,
            best_params=best.params,
            best_run=best.user_attrs.get("run_dir"),
            best_trial=best.number,
        )
    reasons = sorted(
        {str(t.user_attrs["infeasible"]) for t in trials if "infeasible" in t.user_attrs}
    )
    if reasons:
        out["infeasible_reasons"] = reasons
    return out
