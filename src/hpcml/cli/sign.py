"""`hpcml export sign|verify`: sign an export folder, check one (OpenSSF model-signing)."""

from __future__ import annotations

from pathlib import Path

import typer

from hpcml.cli.common import console, print_json


def sign(
    path: Path = typer.Argument(..., help="Run folder or export folder to sign."),
    key: Path = typer.Option(
        ...,
        "--key",
        help="Elliptic curve private key (PEM) to sign with; kept away from the model.",
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Sign an export: every file's sha256 signed with KEY into model.sig (sign last: a file
    written into the folder afterwards, such as model.onnx, breaks the signature)."""
    from hpcml.models.signing import sign_export

    signature = sign_export(path, key)
    if json_out:
        print_json({"signature": str(signature)})
    else:
        console.print(f"signed {signature.parent} -> {signature}")


def verify(
    path: Path = typer.Argument(..., help="Run folder or export folder to check."),
    key: Path = typer.Option(..., "--key", help="The signer's public key (PEM)."),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Check an export against its model.sig and the signer's public key (exit 2 if it fails)."""
    from hpcml.models.signing import verify_export

    folder = verify_export(path, key)
    if json_out:
        print_json({"export": str(folder), "verified": True})
    else:
        console.print(f"{folder}: signature verified")


def register(export_app: typer.Typer) -> None:
    """Add `sign` and `verify` to `hpcml export`."""
    export_app.command("sign", help=sign.__doc__)(sign)
    export_app.command("verify", help=verify.__doc__)(verify)
