"""`hpcml profile CONFIG`: a short training run under torch.profiler (`train.profile`)."""

from __future__ import annotations

from pathlib import Path

import typer


def profile(
    config: Path = typer.Argument(..., help="YAML config, e.g. examples/digits_cnn.yaml."),
    overrides: list[str] = typer.Argument(None, help="Dotted overrides, e.g. data.num_workers=2."),
    steps: int = typer.Option(5, "--steps", min=1, help="Steps to record (after 3 skipped)."),
    nproc: int = typer.Option(1, "--nproc", help="Processes on this machine (DDP with >1)."),
    run_dir: Path | None = typer.Option(None, "--run-dir", help="Output folder."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a finished run there."),
    quiet: bool = typer.Option(False, "--quiet", help="Log lines instead of a progress bar."),
    json_out: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Profile a few training steps: a Chrome/Perfetto trace per rank and where step time goes
    (data, compute, other; collectives in flight) in RUN_DIR/profile/."""
    from hpcml.cli.train import train

    wait, warmup = 2, 1
    extra = [
        f"train.profile={{wait: {wait}, warmup: {warmup}, active: {steps}}}",
        f"train.max_steps={wait + warmup + steps}",
        "train.eval_every=0",
    ]
    # Every parameter given: called directly, typer's defaults would be OptionInfo objects.
    train(config, [*(overrides or []), *extra], nproc, run_dir, None, overwrite, quiet, 0,
          json_out, False, False)
