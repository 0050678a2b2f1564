"""What a study holds, as `hpcml tune` prints it (trial counts by outcome and the best trial),
and its report page (`--report`).

A failed trial that was queued again (its worker died) is not counted: its retry is.
"""

from __future__ import annotations

import html
import json
import warnings
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import RetryHeartbeatStaleTrialCallback
from optuna.trial import FrozenTrial, TrialState

from hpcml.records import write_text_atomic


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
