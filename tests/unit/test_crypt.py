"""hpcml.crypt: sealed files round-trip, get a fresh nonce each, and refuse another key, a
changed byte and a malformed key, each in one sentence; a key file beside the data is refused."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from hpcml import crypt

KEY = crypt.parse_key(b"ab" * 32, "test")
OTHER = crypt.parse_key(b"cd" * 32, "test")
DATA = bytes(range(256)) * 40


def test_round_trip_with_a_fresh_nonce_per_file() -> None:
    a, b = crypt.seal(DATA, KEY), crypt.seal(DATA, KEY)
    assert crypt.unseal(a, KEY, "a") == DATA == crypt.unseal(b, KEY, "b")
    assert a != b  # a nonce reused under one key would reveal the XOR of two plaintexts
    assert DATA[:64] not in a and crypt.is_sealed(a)


def test_another_key_and_a_changed_byte_are_told_apart() -> None:
    blob = crypt.seal(DATA, KEY)
    with pytest.raises(crypt.EncryptionError, match="another key"):
        crypt.unseal(blob, OTHER, "f")
    for at in (crypt.HEADER_BYTES - 1, crypt.HEADER_BYTES + 100, len(blob) - 1):  # nonce, data, tag
        changed = bytearray(blob)
        changed[at] ^= 0x01
        with pytest.raises(crypt.EncryptionError, match="does not decrypt"):
            crypt.unseal(bytes(changed), KEY, "f")


def test_key_forms_and_malformed_keys() -> None:
    secret = bytes(range(32))
    for text in (secret.hex().encode(), base64.b64encode(secret), secret):
        assert crypt.parse_key(text, "k").secret == secret
    for bad in (b"", b"ab" * 31, b"zz" * 32, b"not a key"):
        with pytest.raises(crypt.EncryptionError, match="is not 32 bytes"):
            crypt.parse_key(bad, "k")
    assert secret.hex() not in repr(crypt.parse_key(secret, "k"))


def test_run_key_refuses_a_key_file_inside_the_run_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    (run / "keys").mkdir(parents=True)
    inside, outside = run / "keys" / "k", tmp_path / "k"
    for p in (inside, outside):
        p.write_text("ab" * 32)
    with pytest.raises(crypt.EncryptionError, match="inside the run folder"):
        crypt.run_key(True, str(inside), run)
    assert crypt.run_key(True, str(outside), run).secret == KEY.secret  # type: ignore[union-attr]
    assert crypt.run_key(False, str(inside), run) is None
    monkeypatch.delenv(crypt.KEY_ENV, raising=False)
    monkeypatch.delenv(crypt.KEY_FILE_ENV, raising=False)
    with pytest.raises(crypt.EncryptionError, match="no key is given"):
        crypt.run_key(True, None, run)
    monkeypatch.setenv(crypt.KEY_FILE_ENV, str(outside))
    assert crypt.run_key(True, None, run).secret == KEY.secret  # type: ignore[union-attr]
