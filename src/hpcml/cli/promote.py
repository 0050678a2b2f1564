"""`hpcml promote RUN --model NAME`: the CI step between training and serving."""

from __future__ import annotations

from pathlib import Path

import typer

from hpcml.cli.common import audit_log_option, console, print_json, reason_option


def promote(
    run_dir: Path = typer.Argument(..., help="The candidate: a finished `hpcml train` run folder."),
    model: str = typer.Option(..., "--model", help="Registered model name."),
    alias: str = typer.Option(
        "production", "--alias", help="Alias to move: staging or production."
    ),
    metric: str = typer.Option("accuracy", "--metric", help="accuracy or loss."),
    min_gain: float = typer.Option(
        0.0, "--min-gain", help="Gain over the current holder the test must show, e.g. 0.005."
    ),
    confidence: float = typer.Option(
        0.95, "--confidence", help="One-sided confidence of the paired test."
    ),
    eval_config: Path | None = typer.Option(
        None,
        "--eval",
        help="Config whose data section names the held-out set (its validation split); "
        "default the candidate run's own.",
    ),
    max_size_mb: float | None = typer.Option(
        None, "--max-size-mb", help="Gate: the export's size."
    ),
    latency_budget_ms: float | None = typer.Option(
        None,
        "--latency-budget-ms",
        help="Gate: p99 latency of the candidate under `hpcml loadtest` at --latency-rate.",
    ),
    latency_rate: float = typer.Option(20.0, "--latency-rate", help="Requests per second."),
    latency_duration: float = typer.Option(
        5.0, "--latency-duration", help="Seconds of load for the latency gate."
    ),
    tracking_uri: str | None = typer.Option(
        None, "--tracking-uri", help="MLflow tracking/registry URI (default $MLFLOW_TRACKING_URI)."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the decision as JSON."),
    trust_code: bool = typer.Option(
        False,
        "--trust-code",
        help="Let exports whose model.json names an import path (pkg.mod:build) run that code, "
        "to score, smoke-test and serve them; only for models from people you trust.",
    ),
    reason: str = reason_option(),
    audit_log: Path | None = audit_log_option(),
) -> None:
    """Evaluate the candidate and the version behind the alias on the same held-out set, decide
    with a paired test (bootstrap; McNemar for accuracy), check the gates (smoke inference,
    size, p99 latency), register the candidate and move the alias only if all pass.

    Exit codes: 0 promoted, 3 not promoted (not better, or a gate failed), 2 bad input."""
    from hpcml.deploy.promote import Gates, promote_run
    from hpcml.errors import ConfigError
    from hpcml.track.audit import Attribution
    from hpcml.track.registry import EXIT_NOT_PROMOTED

    if latency_rate <= 0 or latency_duration <= 0:
        raise ConfigError("--latency-rate and --latency-duration must be above 0.")
    by = Attribution.local(reason, audit_log)  # a bad --audit-log before any evaluation
    gates = Gates(max_size_mb, latency_budget_ms, latency_rate, latency_duration)
    outcome = promote_run(
        run_dir, model, alias, metric, min_gain, confidence, eval_config, gates, tracking_uri,
        trust_code, by,
    )  # fmt: skip
    if json_out:
        print_json(outcome.to_dict())
    else:
        verdict = "[green]promoted[/]" if outcome.promoted else "[yellow]not promoted[/]"
        console.print(
            f"{verdict}: {model} version {outcome.candidate_version} -> {alias} "
            f"(current: {outcome.incumbent_version or 'none'})"
        )
        console.print(f"why: {outcome.reason}")
        for gate, result in outcome.gates.items():
            console.print(f"gate {gate}: {'passed' if result['passed'] else 'FAILED'} {result}")
    if not outcome.promoted:
        raise typer.Exit(EXIT_NOT_PROMOTED)
