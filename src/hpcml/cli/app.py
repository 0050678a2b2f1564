"""The `hpcml` typer application. Each verb group lives in its own module and is added here."""

from __future__ import annotations

import os
import sys

import typer

from hpcml.cli import data as data_cli
from hpcml.cli import launch as launch_cli
from hpcml.cli import model as model_cli
from hpcml.cli import plan as plan_cli
from hpcml.cli import registry as registry_cli
from hpcml.cli import serve as serve_cli
from hpcml.cli import train as train_cli
from hpcml.cli.common import fail
from hpcml.errors import HpcmlError

app = typer.Typer(
    name="hpcml",
    help="Plan, feed, train, track, serve, watch and launch ML workloads on HPC hardware.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

app.command(
    "train",
    context_settings={"allow_extra_args": False},
    help="Train a model from a YAML config on one process or N (DDP, ZeRO/FSDP, TP).",
)(train_cli.train)
app.add_typer(model_cli.app, name="model")
app.add_typer(data_cli.app, name="data")
app.add_typer(plan_cli.app, name="plan")
app.add_typer(registry_cli.app, name="registry")
app.add_typer(launch_cli.app, name="launch")
serve_cli.register(app)


def main() -> None:
    try:
        app()
    except HpcmlError as exc:
        if os.environ.get("RANK", "0") != "0":  # every rank sees the same error; rank 0 tells it
            raise SystemExit(exc.exit_code) from None
        fail(exc.message, exc.exit_code)
    except KeyboardInterrupt:
        fail("interrupted.", 130)


if __name__ == "__main__":
    main()
    sys.exit(0)
