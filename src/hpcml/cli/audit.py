"""`hpcml audit verify FILE`: check an audit log's hash chain (`hpcml.track.audit`)."""

from __future__ import annotations

from pathlib import Path

import typer

from hpcml.cli.common import console, print_json

app = typer.Typer(
    help="The hash-chained audit log of admin actions, promotions, rollbacks and traffic changes.",
    no_args_is_help=True,
)


@app.command("verify")
def verify_cmd(
    path: Path = typer.Argument(..., help="The audit log (JSON lines) to check."),
    json_out: bool = typer.Option(False, "--json", help="Print the verdict as JSON."),
) -> None:
    """Check that no record was edited, deleted, inserted or reordered.

    Exit codes: 0 the chain is intact, 1 it is broken (the first broken line is named), 2 bad
    input."""
    from hpcml.track.audit import verify

    verdict = verify(path)
    if json_out:
        print_json({
            "path": str(path), "intact": verdict.intact, "records": verdict.records,
            "last_hash": verdict.last_hash, "broken_line": verdict.broken_line,
            "problem": verdict.problem or None,
        })  # fmt: skip
    elif verdict.intact:
        console.print(
            f"{path}: {verdict.records} records, chain intact (last hash {verdict.last_hash})",
            highlight=False, soft_wrap=True,
        )  # fmt: skip
    else:
        console.print(
            f"[bold red]broken:[/] line {verdict.broken_line} of {path} breaks the chain: "
            f"{verdict.problem}.", highlight=False, soft_wrap=True,
        )  # fmt: skip
    if not verdict.intact:
        raise typer.Exit(1)
