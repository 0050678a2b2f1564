"""Signed exports: `hpcml export sign` and `hpcml serve --require-signature`.

An export folder is signed with the OpenSSF `model-signing` package (key based: an elliptic
curve private key in PEM): every file of the folder is hashed (sha256), the list of files and
digests is signed, and the signature (a Sigstore bundle) is written into the folder as
`model.sig`. Verification hashes the folder again and compares it with what was signed, so a
changed byte, a removed file or an added one (a `model.onnx` written after signing) fails.

Files the registry writes beside an export when it is logged to MLflow (`MLmodel` and its
environment files) describe the model and are not served; they are left out of the signature,
as they are out of the registry's sha256 (`hpcml.track.mlmodel`), so a signed export stays
verifiable after a round trip through the registry.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpcml.errors import ModelError

SIGNATURE = "model.sig"
# Not part of what is served (hpcml.track.mlmodel's _NOT_DIGESTED, and the signature itself).
UNSIGNED = (SIGNATURE, "MLmodel", "conda.yaml", "python_env.yaml", "requirements.txt")


def _hashing(folder: Path) -> Any:
    from model_signing import hashing

    return (
        hashing.Config()
        .use_file_serialization(hashing_algorithm="sha256", allow_symlinks=False)
        .set_ignored_paths(paths=list(UNSIGNED), ignore_git_paths=True)  # relative to folder
    )


def _export_folder(path: Path) -> Path:
    from hpcml.models.export import META

    path = Path(path)
    if (path / "export" / META).is_file():
        return path / "export"
    if not (path / META).is_file():
        state = "does not exist" if not path.exists() else f"holds no {META}"
        raise ModelError(f"{path} {state}; pass a run folder or its export/ folder.")
    return path


def _pem(path: Path, what: str, option: str) -> Path:
    path = Path(path)
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise ModelError(
            f"{option} {path}: {exc.strerror or exc}; pass the {what} (PEM)."
        ) from None
    if b"-----BEGIN" not in text:
        raise ModelError(f"{option} {path} is not a PEM file; pass the {what} (PEM).")
    return path


def sign_export(path: Path, key: Path) -> Path:
    """Sign the export folder at `path` (or the run folder holding it) with the elliptic curve
    private key `key`; the signature replaces any earlier `model.sig`. Returns its path."""
    folder = _export_folder(path)
    _pem(key, "elliptic curve private key", "--key")
    from model_signing import signing  # after the cheap checks: its import takes a while

    try:
        config = signing.Config().use_elliptic_key_signer(private_key=key)
    except Exception as exc:  # noqa: BLE001 - any unreadable key is the same user problem
        raise ModelError(
            f"--key {key} cannot be used to sign ({_reason(exc)}); pass an elliptic curve "
            "private key in PEM (openssl ecparam -name prime256v1 -genkey -noout)."
        ) from None
    tmp = folder / (SIGNATURE + ".tmp")
    config.set_hashing_config(_hashing(folder)).sign(folder, tmp)
    tmp.replace(folder / SIGNATURE)
    return folder / SIGNATURE


def verify_export(path: Path, public_key: Path) -> Path:
    """Check that the export folder at `path` is exactly what `public_key`'s owner signed.

    Raises `ModelError` (one sentence) when the signature is missing, made with another key,
    or the files differ from the signed ones. Returns the export folder."""
    folder = _export_folder(path)
    signature = folder / SIGNATURE
    _pem(public_key, "public key of the signer", "--verify-key")
    if not signature.is_file():
        raise ModelError(
            f"{folder} is not signed (no {SIGNATURE}); sign it with `hpcml export sign "
            f"{folder} --key KEY` or serve without --require-signature."
        )
    from model_signing import verifying

    try:
        config = verifying.Config().use_elliptic_key_verifier(public_key=public_key)
    except Exception as exc:  # noqa: BLE001
        raise ModelError(
            f"--verify-key {public_key} cannot be used ({_reason(exc)}); pass the signer's "
            "elliptic curve public key in PEM."
        ) from None
    try:
        config.set_hashing_config(_hashing(folder)).verify(folder, signature)
    except Exception as exc:  # noqa: BLE001 - every failure means: do not serve this model
        raise ModelError(
            f"{folder} fails its signature check ({_reason(exc)}): its files are not what "
            f"{public_key}'s key signed; refusing to serve it."
        ) from None
    return folder


def _reason(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 160 else text[:157] + "..."
