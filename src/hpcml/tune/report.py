"""What a study holds, as `hpcml tune` prints it (trial counts by outcome and the best trial),
and its report page (`--report`).

A failed trial that was queued again (its worker died) is not counted: its retry is.

The best of many trials scored on one validation set is partly luck: for an accuracy, the
summary gives one binomial standard error of the best value on the samples it was scored on,
sqrt(p (1 - p) / n), and the complete trials within it of the best (`tied_with_best`), which
that set cannot tell from it. For a language model's per-token accuracy n is its sequences,
so the error is an upper bound (a sequence's tokens are not independent draws, but the
variance of a per-sequence mean in [0, 1] is at most p (1 - p)).
"""

from __future__ import annotations

import html
import json
import math
import warnings
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import RetryHeartbeatStaleTrialCallback
from optuna.trial import FrozenTrial, TrialState

from hpcml.records import write_text_atomic

EVAL_SAMPLES_ATTR = "eval_samples"
"""A complete trial's user attribute: the samples its value was scored on."""


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


def summary(study: optuna.Study, storage: str, metric: str = "") -> dict[str, Any]:
    """The study as `hpcml tune --json` prints it; `metric` (tune.metric) names the value, and
    an accuracy's gets its standard error and the trials tied with the best."""
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
        out.update(ties(study, best, metric))
    reasons = sorted(
        {str(t.user_attrs["infeasible"]) for t in trials if "infeasible" in t.user_attrs}
    )
    if reasons:
        out["infeasible_reasons"] = reasons
    return out


def ties(study: optuna.Study, best: FrozenTrial, metric: str) -> dict[str, Any]:
    """For an accuracy scored on n samples: the best value's standard error and the other
    complete trials within it, best first (see the module docstring); else nothing."""
    n = best.user_attrs.get(EVAL_SAMPLES_ATTR)
    if not metric.endswith("val_accuracy") or not n or best.value is None:
        return {}
    p = min(max(best.value, 0.0), 1.0)
    error = math.sqrt(p * (1 - p) / n)
    close = [
        t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if t.number != best.number and t.value is not None and abs(best.value - t.value) <= error
    ]  # fmt: skip
    close.sort(key=lambda t: (abs(best.value - t.value), t.number))  # type: ignore[operator]
    return {
        "best_standard_error": error,
        "best_scored_on": int(n),
        "tied_with_best": [t.number for t in close],
    }


PLOTS = ("history", "intermediate", "parallel", "importances")


def write_report(study: optuna.Study, folder: Path, result: dict[str, Any]) -> Path:
    """`folder/index.html` with PNGs drawn by Optuna's matplotlib visualization: the
    optimization history, each trial's intermediate values (where pruned trials stop), a
    parallel-coordinate plot and parameter importances. A plot the study cannot have yet is
    left out and the page says why."""
    folder.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():  # "experimental", "too few trials": the page says enough
        warnings.simplefilter("ignore")
        parts = _draw(study, folder)
    head = [
        f"<h1>study {html.escape(study.study_name)}</h1>",
        f"<pre>{html.escape(json.dumps(result, indent=2, default=str))}</pre>",
    ]
    page = folder / "index.html"
    write_text_atomic(
        page, "<!doctype html><meta charset=utf-8>\n" + "\n".join(head + parts) + "\n"
    )
    return page


def _draw(study: optuna.Study, folder: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as vis

    draw = {
        "history": vis.plot_optimization_history,
        "intermediate": vis.plot_intermediate_values,
        "parallel": vis.plot_parallel_coordinate,
        "importances": vis.plot_param_importances,
    }
    parts: list[str] = []
    for name in PLOTS:
        try:
            ax: Any = draw[name](study)
        except (ValueError, RuntimeError) as exc:  # too few trials for this plot
            parts.append(f"<p>{name}: not drawn ({html.escape(str(exc))})</p>")
            continue
        fig: Any = ax.figure
        fig.savefig(folder / f"{name}.png", dpi=100, bbox_inches="tight")
        plt.close(fig)
        parts.append(f'<h2>{name}</h2><img src="{name}.png" alt="{name}">')
    return parts
