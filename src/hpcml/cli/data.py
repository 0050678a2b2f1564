"""`hpcml data prepare CORPUS --out DIR`: turn a corpus into token files for `data.source: tokens`."""

from __future__ import annotations

from pathlib import Path

import typer

from hpcml.cli.common import console, print_json

app = typer.Typer(help="Prepare data sets for training.", no_args_is_help=True)

CORPORA = ("pystdlib",)


@app.command("prepare")
def prepare(
    corpus: str = typer.Argument(
        ..., help="pystdlib: the Python standard library's own source files, as byte tokens."
    ),
    out: Path = typer.Option(..., "--out", help="Folder for train.bin, val.bin and meta.json."),
    val_fraction: float = typer.Option(
        0.05, "--val-fraction", help="Share of files held out for validation (by path hash)."
    ),
    max_bytes: int | None = typer.Option(
        None, "--max-bytes", help="Stop after about this many bytes (small corpora for tests)."
    ),
    json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Write uint16 token files (train.bin, val.bin) and meta.json for data.source tokens."""
    from hpcml.data.tokens import prepare_pystdlib
    from hpcml.errors import DataError

    if corpus not in CORPORA:
        raise DataError(f"corpus '{corpus}' is not known; known corpora are: {', '.join(CORPORA)}.")
    meta = prepare_pystdlib(out, val_fraction=val_fraction, max_bytes=max_bytes)
    if json_out:
        print_json({"out": str(out), **meta})
        return
    from rich.table import Table

    table = Table(title=f"{corpus} -> {out}")
    table.add_column("split")
    table.add_column("files", justify="right")
    table.add_column("tokens", justify="right")
    for split in ("train", "val"):
        table.add_row(split, f"{meta['files'][split]:,}", f"{meta['tokens'][split]:,}")
    console.print(table)
    console.print(
        f"byte-level tokens (vocabulary {meta['vocab_size']}) from {meta['stdlib']}; "
        f"train with data.source=tokens data.path={out}",
        highlight=False,
    )
