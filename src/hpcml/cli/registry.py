"""`hpcml registry register|list|promote|resolve`: the MLflow model registry."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from hpcml.cli.common import audit_log_option, console, print_json, reason_option

app = typer.Typer(
    help=(
        "The model registry (MLflow): register a run's exported model, list versions, move the "
        "staging/production aliases, gate promotion on a metric."
    ),
    no_args_is_help=True,
)

URI_HELP = (
    "MLflow tracking/registry URI; default $MLFLOW_TRACKING_URI, else sqlite:///<cwd>/mlruns.db."
)


def _uri_option() -> Any:
    return typer.Option(None, "--tracking-uri", help=URI_HELP)


def _json_option() -> Any:
    return typer.Option(False, "--json", help="Machine-readable output.")


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _versions_table(title: str, rows: list[dict[str, Any]]) -> Table:
    table = Table(title=title)
    for col, justify in (
        ("version", "right"),
        ("aliases", "left"),
        ("val_accuracy", "right"),
        ("val_loss", "right"),
        ("created (UTC)", "left"),
        ("run", "left"),
        ("trained in", "left"),
    ):
        # What a person reads the table for (version, aliases, metrics) is never cut or folded
        # on a narrow terminal; the long columns (time, run id, folder) fold instead.
        key = col in ("version", "aliases", "val_accuracy", "val_loss")
        table.add_column(
            col,
            justify=justify,  # type: ignore[arg-type]
            overflow="fold",
            no_wrap=key,
            min_width=len("production") if col == "aliases" else None,
        )
    for r in rows:
        table.add_row(
            str(r["version"]),
            ", ".join(r["aliases"]) or "-",
            _fmt(r["metrics"].get("val_accuracy")),
            _fmt(r["metrics"].get("val_loss")),
            r["created"].replace("+00:00", ""),
            (r["run_id"] or "-")[:12],
            r["tags"].get("run_dir", "-"),
        )
    return table


@app.command(
    "register",
    help=(
        "Create a model version from RUN_DIR/export, linked to the run's MLflow run (logged now "
        "if the run was trained without tracking), tagged with its final metrics and provenance."
    ),
)
def register_cmd(
    run_dir: Path = typer.Argument(
        ..., help="A finished run folder (holding export/ and summary.json)."
    ),
    name: str = typer.Option(..., "--name", help="Registered model name, e.g. digits-cnn."),
    alias: str | None = typer.Option(
        None, "--alias", help="Also point this alias at the new version: staging or production."
    ),
    description: str | None = typer.Option(None, "--description", help="Version description."),
    tracking_uri: str | None = _uri_option(),
    json_out: bool = _json_option(),
    reason: str = reason_option(),
    audit_log: Path | None = audit_log_option(),
) -> None:
    """Register a run's export as a new model version."""
    from hpcml.track.audit import Attribution
    from hpcml.track.registry import register_run

    by = Attribution.local(reason, audit_log) if alias is not None else None
    info = register_run(
        run_dir, name, tracking_uri=tracking_uri, alias=alias, description=description, by=by
    )
    if json_out:
        print_json(info)
        return
    console.print(_versions_table(f"registered {name} version {info['version']}", [info]))
    console.print(
        f"load it with [bold]models:/{name}/{info['version']}[/]  (store {info['tracking_uri']})"
    )


@app.command("list")
def list_cmd(
    name: str = typer.Argument(..., help="Registered model name."),
    tracking_uri: str | None = _uri_option(),
    json_out: bool = _json_option(),
) -> None:
    """List the versions of a registered model, newest first, with aliases and metrics."""
    from hpcml.track.registry import list_versions

    rows = list_versions(name, tracking_uri=tracking_uri)
    if json_out:
        print_json(rows)
        return
    console.print(_versions_table(f"model {name}", rows))


@app.command(
    "promote",
    help=(
        "Point the staging/production alias at a version. With --if-better METRIC it is a CI "
        "gate: the candidate (--version, default the newest) is promoted only if its METRIC is "
        "better than the current holder's; a model with no holder is promoted.\n\n"
        "Exit codes: 0 promoted, 3 not promoted (not better), 2 bad input."
    ),
)
def promote_cmd(
    name: str = typer.Argument(..., help="Registered model name."),
    version: int | None = typer.Option(
        None,
        "--version",
        help="Version to promote (with --if-better: the candidate; default the newest).",
    ),
    to: str = typer.Option("production", "--to", help="Alias to move: staging or production."),
    if_better: str | None = typer.Option(
        None,
        "--if-better",
        help="Promote only when this metric beats the alias holder's, e.g. val_accuracy.",
    ),
    mode: str | None = typer.Option(
        None,
        "--mode",
        help="max or min: which way METRIC improves (default: min for names with loss/error, else max).",
    ),
    min_delta: float = typer.Option(
        0.0, "--min-delta", help="Required improvement over the current holder."
    ),
    tracking_uri: str | None = _uri_option(),
    json_out: bool = _json_option(),
    reason: str = reason_option(),
    audit_log: Path | None = audit_log_option(),
) -> None:
    """Move an alias, explicitly or through the metric gate."""
    from hpcml.track.audit import Attribution
    from hpcml.track.registry import (
        EXIT_NOT_PROMOTED,
        RegistryError,
        promote,
        promote_if_better,
    )

    if mode is not None and mode not in ("max", "min"):
        raise RegistryError(f"--mode {mode!r} is not allowed; use max or min.")
    by = Attribution.local(reason, audit_log)
    if if_better is None:
        if version is None:
            raise RegistryError(
                "promote needs --version V (explicit promotion) or --if-better METRIC (the gate)."
            )
        info = promote(name, version, alias=to, tracking_uri=tracking_uri, by=by)
        if json_out:
            print_json({"promoted": True, **info})
            return
        console.print(f"[green]promoted[/] {name} version {version} to {to}")
        return
    decision = promote_if_better(
        name,
        if_better,
        version=version,
        alias=to,
        mode=mode,  # type: ignore[arg-type]
        min_delta=min_delta,
        tracking_uri=tracking_uri,
        by=by,
    )
    if json_out:
        print_json(decision.to_dict())
    else:
        table = Table(title=f"promotion gate: {name} -> {to}", show_header=False)
        table.add_column("key")
        table.add_column("value")
        table.add_row(
            "candidate",
            f"version {decision.candidate_version}: {decision.metric} = {_fmt(decision.candidate_value)}",
        )
        inc = (
            "none"
            if decision.incumbent_version is None
            else (
                f"version {decision.incumbent_version}: {decision.metric} = {_fmt(decision.incumbent_value)}"
            )
        )
        table.add_row(f"current {to}", inc)
        table.add_row("better is", decision.mode)
        table.add_row(
            "decision", "[green]promoted[/]" if decision.promoted else "[yellow]not promoted[/]"
        )
        table.add_row("why", decision.reason)
        console.print(table)
    if not decision.promoted:
        raise typer.Exit(EXIT_NOT_PROMOTED)


@app.command("resolve")
def resolve_cmd(
    uri: str = typer.Argument(..., help="models:/NAME@ALIAS or models:/NAME/VERSION."),
    tracking_uri: str | None = _uri_option(),
    json_out: bool = _json_option(),
) -> None:
    """Print the local export folder a registry URI points at (what `hpcml serve` loads)."""
    from hpcml.track.resolve import resolve_model

    found = resolve_model(uri, tracking_uri=tracking_uri)
    if json_out:
        print_json(
            {
                "uri": uri,
                "name": found.name,
                "version": found.version,
                "aliases": list(found.aliases),
                "run_id": found.run_id,
                "path": str(found.path),
            }
        )
        return
    console.print(str(found.path), highlight=False, soft_wrap=True)
