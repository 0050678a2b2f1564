"""The `hpcml` typer application. Each verb group lives in its own module and is added here."""

from __future__ import annotations

import sys

import typer

from hpcml.cli import model as model_cli
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
    help=train_cli.__doc__,
)(train_cli.train)
app.add_typer(model_cli.app, name="model")
serve_cli.register(app)


def main() -> None:
    try:
        app()
    except HpcmlError as exc:
        fail(exc.message, exc.exit_code)
    except KeyboardInterrupt:
        fail("interrupted.", 130)


if __name__ == "__main__":
    main()
    sys.exit(0)
