"""`hpcml tune CONFIG [key=value ...]`: a hyperparameter study whose trials are `hpcml train`
runs (hpcml.tune)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from hpcml.errors import ConfigError


def tune(
    config: Path = typer.Argument(
        ..., help="YAML config with a tune section, e.g. examples/tune_digits.yaml."
    ),
    overrides: list[str] = typer.Argument(
        None, help="Dotted overrides for every trial, e.g. train.max_steps=100."
    ),
    trials: int | None = typer.Option(
        None, "--trials", help="Trials the study holds when done (default tune.trials)."
    ),
    workers: int = typer.Option(
        1, "--workers", help="Trials run at once on this machine, sharing the study."
    ),
    nproc: int = typer.Option(1, "--nproc", help="Processes of each trial (hpcml train --nproc)."),
    out: Path | None = typer.Option(
        None,
        "--out",
        help="Study folder: trials/ (one run folder each) and study.journal (default "
        "runs/tune-<config>); the same folder continues the study.",
    ),
    storage: str | None = typer.Option(
        None,
        "--storage",
        help="Study storage: journal:PATH (Optuna's journal file, safe on NFS) or an Optuna "
        "RDB URL, e.g. sqlite:///study.db or postgresql+psycopg://host/db "
        "(default journal:OUT/study.journal).",
    ),
    study: str | None = typer.Option(
        None, "--study", help="Study name in the storage (default the config's file name)."
    ),
    first_worker: int = typer.Option(
        0,
        "--first-worker",
        help="Number of this tune's first worker (seeds its sampler): give each tune on one "
        "study its own, e.g. hpcml launch slurm --tune-workers gives the array task id.",
    ),
    register: str | None = typer.Option(
        None,
        "--register",
        help="Register the best trial's export as a new version of this model in the MLflow "
        "registry (tracking.uri's store), linked to its training run.",
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the result as one JSON line."),
    report: bool = typer.Option(
        False, "--report", help="Write OUT/report/index.html: history, pruning, importances."
    ),
) -> None:
    """Search hyperparameters with Optuna: each trial is an `hpcml train` run in its own
    folder, pruned early from its evaluations; rerun the command to continue the study."""
    for name, value in (("--trials", trials), ("--workers", workers), ("--nproc", nproc)):
        if value is not None and value < 1:
            raise ConfigError(f"{name} is {value}; give at least 1.")
    if first_worker < 0:
        raise ConfigError(f"--first-worker is {first_worker}; give 0 or more.")
    if register is not None:
        from hpcml.track.registry import check_name

        check_name(register)  # before any trial
    try:
        from hpcml.tune import budget
        from hpcml.tune import storage as storage_mod
        from hpcml.tune import study as st
    except ImportError:
        raise ConfigError(
            "hpcml tune needs Optuna, which is not installed; pip install 'hpcml[tune]'."
        ) from None
    from hpcml.launch.local import check_nproc

    check_nproc(nproc)
    prep = st.prepare(config, tuple(overrides or ()))
    largest_trial = budget.trial_samples(prep.cfg, prep.dists, nproc)
    budget.check_samples(prep.tune, largest_trial)
    folder = out if out is not None else Path("runs") / f"tune-{config.stem}"
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"--out {folder} is a file, not a folder; choose another path.")
    folder.mkdir(parents=True, exist_ok=True)
    url = storage or storage_mod.default_storage(folder)
    name = study or config.stem
    job = st.TuneJob(
        config=config,
        overrides=tuple(overrides or ()),
        out=folder,
        storage=url,
        study=name,
        trials=trials or prep.tune.trials,
        nproc=nproc,
        timeout_s=prep.tune.timeout_s,
        step_budget=prep.tune.step_budget,
        trial_steps=budget.trial_steps(prep.cfg, prep.dists),
        sample_budget=prep.tune.sample_budget,
        trial_samples=largest_trial,
        known=storage_mod.known_trials(url, name),
        first_worker=first_worker,
    )
    result = st.run_study(job, workers, verbose=not json_out, report=report)
    if register is not None:
        result["registered"] = register_best(result, register, prep.cfg.tracking.uri)
    if json_out:
        import json
        import sys

        sys.stdout.write(json.dumps(result, default=str) + "\n")
        return
    show(result, prep.tune.metric)


def register_best(result: dict[str, Any], name: str, uri: str | None) -> dict[str, Any] | None:
    """The best trial's export as a new version of `name` (None when no trial completed)."""
    from hpcml.track.registry import register_run

    if result["best_run"] is None:
        return None
    info = register_run(
        Path(result["best_run"]),
        name,
        tracking_uri=uri,
        description=f"best trial ({result['best_trial']}) of study {result['study']}",
    )
    return {"name": name, "version": info["version"], "run_id": info["run_id"]}


def show(result: dict[str, Any], metric: str) -> None:
    from rich.table import Table

    from hpcml.cli.common import console

    t = Table(title=f"study {result['study']} ({result['storage']})", show_header=False)
    t.add_column("what")
    t.add_column("value")
    n = result["trials"]
    t.add_row("trials", ", ".join(f"{v} {k}" for k, v in n.items()))
    if result["best_value"] is not None:
        t.add_row(f"best {metric}", f"{result['best_value']:.4f}")
        if "best_standard_error" in result:
            tied = result["tied_with_best"]
            t.add_row(
                "  within one standard error",
                f"+/- {result['best_standard_error']:.4f} on {result['best_scored_on']} samples: "
                + (f"{'trial' if len(tied) == 1 else 'trials'} {', '.join(map(str, tied))} "
                   "too, not told apart from it by this set" if tied else "no other trial"),
            )  # fmt: skip
        for key, value in result["best_params"].items():
            t.add_row(f"  {key}", str(value))
        t.add_row("best run", str(result["best_run"]))
    for reason in result.get("infeasible_reasons", []):
        t.add_row("infeasible", reason)
    if result.get("report"):
        t.add_row("report", result["report"])
    if "registered" in result:
        r = result["registered"]
        t.add_row("registered", f"{r['name']} version {r['version']}" if r else "no complete trial")
    console.print(t)
