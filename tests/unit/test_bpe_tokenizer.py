"""The byte-level BPE tokenizer of served text models (hpcml.models.tokenizer), on a tiny BPE
trained here with Hugging Face `tokenizers`: exact bytes per token (text with multi-byte
characters round-trips, token by token through TextStream as well as all at once, and agrees
with `tokenizers`' own decoding), and `hpcml model import-hf` copies or refuses it."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import pytest
from tests.unit.bpe_util import END, save_hf, tiny_gpt2, train_bpe
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from typer.testing import CliRunner

from hpcml.cli.app import app
from hpcml.models.tokenizer import ByteLevelBPE, decode, read_hf_tokenizer
from hpcml.serve.generate.sampling import TextStream

TEXT = "naïve café 日本語 🙂"


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, ByteLevelBPE]:
    hf = train_bpe()
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    hf.save(str(path))
    ours, _ = read_hf_tokenizer(path, hf.token_to_id(END))
    return hf, ours


def test_round_trip_and_token_by_token_streaming(bpe: tuple[Tokenizer, ByteLevelBPE]) -> None:
    hf, tok = bpe
    assert 300 <= tok.vocab_size <= 500 and tok.vocab_size == hf.get_vocab_size()
    ids = tok.encode(TEXT)
    assert ids == hf.encode(TEXT).ids
    pieces = [tok.token_bytes(i) for i in ids]
    # Meaningful only if some token holds part of a character (decoding it alone would fail).
    assert any(_invalid_utf8(p) for p in pieces), pieces
    assert b"".join(pieces) == TEXT.encode()
    assert decode(tok, ids) == TEXT
    stream = TextStream((), tok)
    deltas = [stream.push(i) for i in ids] + [stream.finish(None)]
    assert "".join(deltas) == TEXT
    assert all("\ufffd" not in d for d in deltas)
    # The end token adds no text.
    assert tok.end_token is not None and decode(tok, [*ids, tok.end_token]) == TEXT


def test_bytes_per_token_equal_tokenizers_decoding(bpe: tuple[Tokenizer, ByteLevelBPE]) -> None:
    """Seeded random token sequences (most not valid UTF-8 as a whole): ours decodes exactly as
    `tokenizers` does (both replace invalid bytes by U+FFFD, maximal subparts)."""
    hf, tok = bpe
    rng = random.Random(3)
    end = tok.end_token
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 12))]
        ids = [i for i in ids if i != end]
        assert decode(tok, ids) == hf.decode(ids, skip_special_tokens=True), ids


def _invalid_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def _import(folder: Path, out: Path) -> tuple[int, str]:
    res = CliRunner().invoke(app, ["model", "import-hf", str(folder), "--out", str(out)])
    return res.exit_code, res.output


def test_import_hf_copies_and_records_the_tokenizer(tmp_path: Path) -> None:
    hf = train_bpe()
    vocab, end = hf.get_vocab_size(), hf.token_to_id(END)
    folder = save_hf(tiny_gpt2(vocab, end), hf, tmp_path / "hf")
    code, output = _import(folder, tmp_path / "export")
    assert code == 0, output
    copied = tmp_path / "export" / "tokenizer.json"
    assert copied.read_bytes() == (folder / "tokenizer.json").read_bytes()
    record = json.loads((tmp_path / "export" / "model.json").read_text())["metadata"]["tokenizer"]
    assert record["kind"] == "huggingface-byte-level-bpe"
    assert record["sha256"] == hashlib.sha256(copied.read_bytes()).hexdigest()
    assert record["vocab_size"] == vocab and record["end_token"] == end


def test_import_hf_refuses_tokenizers_it_cannot_serve(tmp_path: Path) -> None:
    hf = train_bpe()
    vocab, end = hf.get_vocab_size(), hf.token_to_id(END)
    folder = save_hf(tiny_gpt2(vocab - 10, end), hf, tmp_path / "small")
    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    wordpiece.decoder = decoders.WordPiece()
    cases = {
        "larger": (None, f"has {vocab} tokens, more than the model's vocab_size of {vocab - 10}"),
        "malformed": ('{"model": {"type": "BPE"', "is not valid JSON"),
        "wordpiece": (wordpiece.to_str(), "cannot map to bytes"),
    }
    for name, (text, words) in cases.items():
        if text is not None:
            (folder / "tokenizer.json").write_text(text)
        out = tmp_path / f"out-{name}"
        code, output = _import(folder, out)
        assert code == 2, (name, output)
        assert words in " ".join(output.split()), (name, output)
        assert "Traceback" not in output and not out.exists()
    # A BPE whose decoder is byte-level but whose tokens are not: refused too.
    unigram_like = Tokenizer(models.BPE())
    unigram_like.decoder = decoders.ByteLevel()
    unigram_like.train_from_iterator(["日本語 日本"], trainers.BpeTrainer(show_progress=False))
    (folder / "tokenizer.json").write_text(unigram_like.to_str())
    code, output = _import(folder, tmp_path / "out-alphabet")
    assert code == 2 and "not in the byte-level alphabet" in " ".join(output.split()), output
