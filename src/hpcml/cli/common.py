"""Shared CLI pieces: console, JSON output, and turning user errors into one line + exit code."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from rich.console import Console

console = Console()
err_console = Console(stderr=True)


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
    sys.stdout.flush()


def fail(message: str, exit_code: int = 2) -> None:
    """Print one sentence for the user and exit; never a traceback."""
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a worker: torch is loaded already
        from hpcml.distributed.runtime import stock_torchrun_note

        note = stock_torchrun_note(exit_code)  # under torchrun's own agent
        if note is not None:
            err_console.print(note, highlight=False, soft_wrap=True)
    raise SystemExit(exit_code)


AUDIT_LOG_ENV = "HPCML_AUDIT_LOG"


def reason_option() -> Any:
    import typer

    return typer.Option(
        "", "--reason", help="Why: kept with the move in the registry's tags and the audit log."
    )


def audit_log_option() -> Any:
    import typer

    return typer.Option(
        None,
        "--audit-log",
        envvar=AUDIT_LOG_ENV,
        help=f"Append a record of the move to this hash-chained audit log (default ${AUDIT_LOG_ENV}).",
    )
