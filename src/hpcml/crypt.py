"""Encryption at rest: AES-256-GCM over whole files (checkpoints, exported weights).

A sealed file is `MAGIC | key id (8 bytes) | nonce (12 bytes) | ciphertext | GCM tag (16)`.
Every file gets a fresh random nonce; the header is the authenticated data, so neither it nor
the ciphertext can change without the tag failing. The key id (the first 8 bytes of
HMAC-SHA256(key, "hpcml key id")) names the key without revealing it: a file sealed with
another key is told apart from a damaged one before anything is decrypted.

The key (32 bytes, written as 64 hex digits or base64) comes from the environment, never from a
file beside the data: `HPCML_ENCRYPTION_KEY` holds it, or `HPCML_ENCRYPTION_KEY_FILE` names a
file holding it (`encryption.key_file` in a run config does the same for training).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
from dataclasses import dataclass
from pathlib import Path

from hpcml.errors import HpcmlError

MAGIC = b"HPCMLAES1\n"
KEY_ENV = "HPCML_ENCRYPTION_KEY"
KEY_FILE_ENV = "HPCML_ENCRYPTION_KEY_FILE"
_NONCE = 12
_ID = 8
HEADER_BYTES = len(MAGIC) + _ID + _NONCE


class EncryptionError(HpcmlError):
    """A missing, malformed or wrong key, or a sealed file that does not decrypt."""


@dataclass(frozen=True)
class Key:
    secret: bytes
    origin: str
    """Where it came from (the variable or file name), for messages; never the key itself."""

    @property
    def key_id(self) -> bytes:
        return hmac.new(self.secret, b"hpcml key id", hashlib.sha256).digest()[:_ID]

    def __repr__(self) -> str:  # never print the secret
        return f"Key(from {self.origin}, id {self.key_id.hex()})"


def parse_key(text: bytes, origin: str) -> Key:
    """32 bytes as 64 hex digits, base64, or raw bytes (a key file)."""
    raw = text.strip()
    secret: bytes | None = None
    if len(raw) == 64:
        try:
            secret = bytes.fromhex(raw.decode("ascii"))
        except (ValueError, UnicodeDecodeError):
            secret = None
    if secret is None:
        try:
            decoded = base64.b64decode(raw, validate=True)
            secret = decoded if len(decoded) == 32 else None
        except (binascii.Error, ValueError):
            secret = None
    if secret is None and len(text) == 32:
        secret = text
    if secret is None:
        raise EncryptionError(
            f"the encryption key in {origin} is not 32 bytes (64 hex digits or base64); make "
            "one with `openssl rand -hex 32`."
        )
    return Key(secret, origin)


def key_from_file(path: Path, origin: str) -> Key:
    try:
        return parse_key(Path(path).read_bytes(), f"{origin} {path}")
    except OSError as exc:
        raise EncryptionError(
            f"{origin} {path} cannot be read ({exc.strerror or exc}); point it at the key file."
        ) from None


def key_from_env(required_for: str | None = None) -> Key | None:
    """The key named by the environment; None when neither variable is set, unless
    `required_for` says what needs it (then one sentence, exit 2)."""
    text = os.environ.get(KEY_ENV)
    if text:
        return parse_key(text.encode(), f"${KEY_ENV}")
    path = os.environ.get(KEY_FILE_ENV)
    if path:
        return key_from_file(Path(path), f"${KEY_FILE_ENV}")
    if required_for is not None:
        raise EncryptionError(
            f"{required_for} is encrypted and no key is given; set ${KEY_ENV} (64 hex digits) "
            f"or ${KEY_FILE_ENV} (a key file kept away from the data)."
        )
    return None


def is_sealed(head: bytes) -> bool:
    return head.startswith(MAGIC)


def file_is_sealed(path: Path) -> bool:
    with open(path, "rb") as f:
        return is_sealed(f.read(len(MAGIC)))


def seal(data: bytes, key: Key) -> bytes:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    header = MAGIC + key.key_id + os.urandom(_NONCE)
    return header + AESGCM(key.secret).encrypt(header[-_NONCE:], data, header)


def check_key(head: bytes, key: Key, where: str) -> None:
    """Refuse a sealed file's header written with another key (one sentence)."""
    if not is_sealed(head):
        raise EncryptionError(f"{where} is not encrypted by hpcml; it cannot be read as such.")
    if head[len(MAGIC) : len(MAGIC) + _ID] != key.key_id:
        raise EncryptionError(
            f"{where} was encrypted with another key than the one in {key.origin}; nothing was "
            "changed: give the key it was written with."
        )


def unseal(blob: bytes, key: Key, where: str) -> bytes:
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    check_key(blob[:HEADER_BYTES], key, where)
    header = blob[:HEADER_BYTES]
    try:
        return AESGCM(key.secret).decrypt(header[-_NONCE:], blob[HEADER_BYTES:], header)
    except InvalidTag:
        raise EncryptionError(
            f"{where} does not decrypt with its key (its bytes were changed after it was "
            "written); use another copy."
        ) from None


def read_maybe_sealed(path: Path, key: Key | None, what: str) -> bytes:
    """The plaintext of `path`: decrypted when sealed (the key from `key` or the environment),
    as is when not."""
    blob = Path(path).read_bytes()
    if not is_sealed(blob):
        return blob
    key = key or key_from_env(required_for=f"{what} {path}")
    assert key is not None
    return unseal(blob, key, str(path))


def write_sealed(path: Path, data: bytes, key: Key) -> None:
    """`path` holds `data` sealed; written whole and fsynced (callers rename it into place)."""
    with open(path, "wb") as f:
        f.write(seal(data, key))
        f.flush()
        os.fsync(f.fileno())


def run_key(enabled: bool, key_file: str | None, run_dir: Path | None) -> Key | None:
    """The key a training run encrypts with (`encryption.enabled`), or None when it does not.

    A key file inside the run folder would sit beside the data it protects: refused."""
    if not enabled:
        return None
    if key_file is not None:
        path = Path(key_file).expanduser()
        if run_dir is not None and path.resolve().is_relative_to(Path(run_dir).resolve()):
            raise EncryptionError(
                f"encryption.key_file {path} lies inside the run folder {run_dir}, beside the "
                "data it protects; keep the key elsewhere."
            )
        return key_from_file(path, "encryption.key_file")
    key = key_from_env()
    if key is None:
        raise EncryptionError(
            f"encryption.enabled is true and no key is given; set ${KEY_ENV} (64 hex digits, "
            f"e.g. from `openssl rand -hex 32`), ${KEY_FILE_ENV} or encryption.key_file."
        )
    return key
