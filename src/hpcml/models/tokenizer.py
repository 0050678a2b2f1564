"""Tokenizers of served text models: text -> token ids, and each token id -> its raw bytes.

Serving streams text token by token, and a token of a byte-level BPE (GPT-2's) may hold half a
UTF-8 character; so a tokenizer here gives the exact bytes of one token, and the text layer
(`hpcml.serve.generate.sampling.TextStream`) joins bytes and decodes them. Decoding one token
at a time to str would break multi-byte characters.

`ByteTokenizer` is UTF-8 itself (the zoo gpt's 256-token vocabulary). `ByteLevelBPE` reads a
Hugging Face `tokenizer.json` with the `tokenizers` library (JSON only: nothing is executed,
no pickle is read) and maps GPT-2's byte-level alphabet back to bytes. A tokenizer file whose
tokens cannot be mapped to bytes (WordPiece, Unigram, byte-fallback BPE) is refused.

An export records its tokenizer in model.json (`metadata.tokenizer`: kind, sha256 of the
file, vocabulary size, end-of-text token) and holds the file as `tokenizer.json`;
`export_tokenizer` loads it back, checking the hash.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Protocol

from hpcml.errors import ConfigError, ModelError

FILE = "tokenizer.json"
KIND = "huggingface-byte-level-bpe"


class Tokenizer(Protocol):
    """What every text endpoint needs from a tokenizer."""

    @property
    def vocab_size(self) -> int:
        """Token ids are below this."""
        ...

    @property
    def end_token(self) -> int | None:
        """Generating this token ends a request (finish_reason "stop"); it is not text."""
        ...

    def encode(self, text: str) -> list[int]: ...

    def token_bytes(self, token: int) -> bytes:
        """The raw bytes of one token (possibly part of a UTF-8 character)."""
        ...


def decode(tokenizer: Tokenizer, tokens: list[int]) -> str:
    """The text of `tokens` (the end token left out; invalid UTF-8 becomes U+FFFD)."""
    data = b"".join(tokenizer.token_bytes(t) for t in tokens if t != tokenizer.end_token)
    return data.decode("utf-8", errors="replace")


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, the zoo gpt's vocabulary; no end token."""

    vocab_size = 256
    end_token: int | None = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def token_bytes(self, token: int) -> bytes:
        return bytes([token]) if 0 <= token < 256 else b""

    def decode(self, tokens: list[int]) -> str:
        return bytes(tokens).decode("utf-8", errors="replace")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet (`bytes_to_unicode` of its encoder.py), char -> byte: the
    printable bytes stand for themselves, the other 68 for the code points 256, 257, ..."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    chars = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


class ByteLevelBPE:
    """A Hugging Face byte-level BPE `tokenizer.json` (GPT-2's kind), read by `tokenizers`."""

    def __init__(self, text: str, where: Path, end_token: int | None = None) -> None:
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            raise ConfigError(
                f"{where} is not valid JSON; give the tokenizer.json that was saved with the model."
            ) from None
        model = data.get("model") if isinstance(data, dict) else None
        decoder = data.get("decoder") if isinstance(data, dict) else None
        model_type = model.get("type") if isinstance(model, dict) else None
        decoder_type = decoder.get("type") if isinstance(decoder, dict) else None
        if model_type != "BPE" or decoder_type != "ByteLevel":
            raise ConfigError(
                f"{where} is a {model_type} tokenizer with a {decoder_type} decoder, whose "
                "tokens hpcml cannot map to bytes; only byte-level BPE (GPT-2's) is served."
            )
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self._tok = HFTokenizer.from_str(text)
        except Exception as exc:  # noqa: BLE001 - the Rust parser's error has no finer type
            raise ConfigError(f"{where} cannot be read by tokenizers ({exc}).") from None
        self._table = self._bytes_table(where)
        self.vocab_size = len(self._table)
        if end_token is not None and not 0 <= end_token < self.vocab_size:
            raise ConfigError(
                f"end-of-text token {end_token} is outside {where}'s vocabulary of "
                f"{self.vocab_size}; fix eos_token_id."
            )
        self.end_token = end_token
        self.chat_template: str | None = None
        """The Jinja chat template of the tokenizer's config, when it has one."""
        self.bos_text: str | None = None
        self.eos_text: str | None = None

    def _bytes_table(self, where: Path) -> list[bytes]:
        alphabet = _byte_level_alphabet()
        added = {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()}
        vocab = self._tok.get_vocab(with_added_tokens=True)
        table = [b""] * (max(vocab.values(), default=-1) + 1)
        for piece, i in vocab.items():
            if i in added:  # added tokens are plain text, outside the byte-level alphabet
                table[i] = added[i].encode("utf-8")
                continue
            try:
                table[i] = bytes(alphabet[c] for c in piece)
            except KeyError:
                raise ConfigError(
                    f"{where}: token {i} ({piece!r}) is not in the byte-level alphabet, so "
                    "hpcml cannot map it to bytes; give a byte-level BPE tokenizer (GPT-2's)."
                ) from None
        return table

    def encode(self, text: str) -> list[int]:
        # No special tokens added (GPT-2 adds none); special tokens written in the text are
        # recognised, as Hugging Face's tokenizers do.
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def token_bytes(self, token: int) -> bytes:
        return self._table[token] if 0 <= token < len(self._table) else b""


def read_hf_tokenizer(path: Path, end_token: int | None = None) -> tuple[ByteLevelBPE, bytes]:
    """The tokenizer of a tokenizer.json file and the file's bytes; refused in one sentence."""
    try:
        data = path.read_bytes()
        text = data.decode("utf-8")
    except OSError as exc:
        raise ConfigError(f"{path} cannot be read ({exc.strerror or exc}).") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not UTF-8 JSON; give the model's tokenizer.json.") from None
    return ByteLevelBPE(text, path, end_token), data


def tokenizer_record(tok: ByteLevelBPE, data: bytes) -> dict[str, Any]:
    """What model.json records about an export's tokenizer."""
    return {
        "kind": KIND,
        "file": FILE,
        "sha256": hashlib.sha256(data).hexdigest(),
        "vocab_size": tok.vocab_size,
        "end_token": tok.end_token,
    }


def export_tokenizer(export_dir: Path, meta: dict[str, Any]) -> ByteLevelBPE | None:
    """The tokenizer model.json records for `export_dir`, or None when it records none."""
    record = (meta.get("metadata") or {}).get("tokenizer")
    if record is None:
        return None
    where = export_dir / "model.json"
    if not isinstance(record, dict) or record.get("kind") != KIND:
        kind = record.get("kind") if isinstance(record, dict) else record
        raise ModelError(f"{where} records a tokenizer of unknown kind {kind!r}; re-import.")
    end = record.get("end_token")
    if end is not None and not isinstance(end, int):
        raise ModelError(f"{where}: tokenizer end_token {end!r} is not a token id; re-import.")
    path = export_dir / FILE  # never a path from the file: it could point anywhere
    if not path.is_file():
        raise ModelError(f"{where} records a tokenizer but {path} is missing; re-import.")
    tok, data = read_hf_tokenizer(path, end)
    if hashlib.sha256(data).hexdigest() != record.get("sha256"):
        raise ModelError(
            f"{path} is not the file {where} records (sha256 differs); re-import the model "
            "rather than replacing its tokenizer."
        )
    for key in ("chat_template", "bos_text", "eos_text"):
        value = record.get(key)
        if value is not None and not isinstance(value, str):
            raise ModelError(f"{where}: tokenizer {key} {value!r} is not text; re-import.")
        setattr(tok, key, value)
    return tok
