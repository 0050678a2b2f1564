"""Train a model from a YAML config on 1..N processes: `hpcml train CONFIG [key=value ...]`."""

from __future__ import annotations

from pathlib import Path

import typer


def train(
    config: Path = typer.Argument(..., help="YAML config, e.g. examples/digits_cnn.yaml."),
    overrides: list[str] = typer.Argument(None, help="Dotted overrides, e.g. optim.lr=0.01 train.max_steps=200."),
    nproc: int = typer.Option(1, "--nproc", help="Processes on this machine; >1 starts torchrun's elastic agent (DDP)."),
    run_dir: Path | None = typer.Option(None, "--run-dir", help="Output folder (default runs/<config>-<time>)."),
    resume: str | None = typer.Option(None, "--resume", help="'auto' (newest complete checkpoint in the run folder) or a checkpoint path."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a run folder that already holds a finished run."),
    quiet: bool = typer.Option(False, "--quiet", help="Log lines instead of a live progress bar."),
    max_restarts: int = typer.Option(0, "--max-restarts", help="Elastic restarts of the whole group after a worker failure (--nproc > 1)."),
    json_out: bool = typer.Option(False, "--json", help="Print the summary as JSON at the end."),
) -> None:
    """Train a model from a YAML config on one process or several (DDP)."""
    from hpcml.train.entry import train_command

    train_command(
        config=config,
        overrides=overrides or [],
        nproc=nproc,
        run_dir=run_dir,
        resume=resume,
        overwrite=overwrite,
        quiet=quiet,
        max_restarts=max_restarts,
        json_out=json_out,
    )
