"""A GPT-2 with a byte-level BPE tokenizer, imported with `hpcml model import-hf` and served by
`hpcml serve` on loopback: the official `openai` client's greedy completions equal
transformers' `generate` decoded by the same tokenizer (`tokenizers`' own decode), stop
sequences that end inside a token cut the text there, the end-of-text token ends generation
with finish_reason "stop", and `hpcml serve` refuses a tokenizer larger than the model's
vocabulary or a malformed tokenizer.json in one sentence.

The end token is made to come up: the rows of `<|endoftext|>` and of the 5th-or-later greedy
token of PROMPTS[0] are swapped in the (tied) embedding, which renames those two tokens in the
model consistently, so the same greedy run now ends with `<|endoftext|>`."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
import transformers
from tests.unit.bpe_util import END, save_hf, tiny_gpt2, train_bpe
from typer.testing import CliRunner

from hpcml.cli.app import app
from hpcml.models.tokenizer import read_hf_tokenizer
from hpcml.serve.config import ServeConfig
from hpcml.serve.protocol.app import build_app
from hpcml.serve.testing import running_server

PROMPTS = ["naïve café", "日本語 🙂 the", "hello wörld"]
MAX_TOKENS = 20
SRC = Path(__file__).resolve().parents[2] / "src"
# A Hugging Face chat template using bos_token and add_generation_prompt (short: the model's
# context is 64 tokens).
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'][0] }}: {{ m['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}a:{% endif %}"
)


def _greedy(model: transformers.GPT2LMHeadModel, ids: list[int], n: int) -> list[int]:
    """transformers' greedy `generate`; asserts a gap of 1e-3 between the best two logits at
    every step, so the server's float32 rounding (batched, paged attention: differences of
    order 1e-6 on logits of order 1) cannot flip a token."""
    out = model.generate(
        torch.tensor([ids]),
        max_new_tokens=n,
        do_sample=False,
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        pad_token_id=model.config.eos_token_id,
        output_scores=True,
        return_dict_in_generate=True,
    )
    for scores in out.scores:
        top2 = torch.topk(scores[0], 2).values
        assert float(top2[0] - top2[1]) > 1e-3, "near-tie in the reference: pick another seed"
    return list(out.sequences[0, len(ids) :].tolist())


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("bpe")
    hf_tok = train_bpe()
    end = hf_tok.token_to_id(END)
    model = tiny_gpt2(hf_tok.get_vocab_size(), end)
    first = hf_tok.encode(PROMPTS[0]).ids
    with torch.no_grad():
        out = _greedy(model, first, MAX_TOKENS)
        k = next(i for i in range(4, MAX_TOKENS) if out[i] not in first + out[:i] + [end])
        wte = model.transformer.wte.weight
        wte[[end, out[k]]] = wte[[out[k], end]]
    folder = save_hf(model, hf_tok, tmp / "hf")
    config = {"chat_template": TEMPLATE, "eos_token": END, "bos_token": END}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    res = CliRunner().invoke(app, ["model", "import-hf", str(folder), "--out", str(tmp / "ex")])
    assert res.exit_code == 0, res.output
    want = {}
    for prompt in PROMPTS:
        ids = _greedy(model, hf_tok.encode(prompt).ids, MAX_TOKENS)
        finish = "stop" if ids[-1] == end else "length"
        want[prompt] = (hf_tok.decode(ids, skip_special_tokens=True), finish, len(ids), ids)
    assert want[PROMPTS[0]][1:3] == ("stop", k + 1)  # the swap made <|endoftext|> come up
    cfg = ServeConfig.model_validate({"defaults": {"isolation": "thread"}})
    with running_server(build_app(tmp / "ex", cfg, name="tiny")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        yield {"client": client, "url": url, "want": want, "export": tmp / "ex", "tmp": tmp,
               "model": model, "folder": folder}


def test_greedy_completions_equal_transformers_generate(served: dict[str, Any]) -> None:
    c = served["client"]
    for prompt, (text, finish, n, _) in served["want"].items():
        done = c.completions.create(
            model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        assert (done.choices[0].text, done.choices[0].finish_reason) == (text, finish), prompt
        assert done.usage is not None and done.usage.completion_tokens == n
        pieces = c.completions.create(
            model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        chunks = [(p.choices[0].text, p.choices[0].finish_reason) for p in pieces]
        assert "".join(t for t, _ in chunks) == text and chunks[-1][1] == finish
    # The OIP generate extension uses the same tokenizer.
    text, finish, _, _ = served["want"][PROMPTS[1]]
    body = {"text_input": PROMPTS[1], "parameters": {"max_tokens": MAX_TOKENS, "temperature": 0}}
    r = httpx.post(f"{served['url']}/v2/models/tiny/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["text_output"] == text and r.json()["details"]["finish_reason"] == finish


def test_chat_uses_the_tokenizer_config_chat_template(served: dict[str, Any]) -> None:
    """The prompt is what transformers' own apply_chat_template renders from the same
    tokenizer_config.json, so the greedy reply equals transformers' generate on it."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the"}]
    hf = transformers.AutoTokenizer.from_pretrained(served["folder"])
    ids = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ids == END + "s: Be brief.\nu: the\na:"  # bos_token and the template were used
    prompt = hf(ids, add_special_tokens=False)["input_ids"]
    out = _greedy(served["model"], prompt, MAX_TOKENS)
    done = served["client"].chat.completions.create(
        model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0  # type: ignore[arg-type]
    )
    assert done.usage is not None and done.usage.prompt_tokens == len(prompt)
    assert done.choices[0].message.content == hf.decode(out, skip_special_tokens=True)


def _stop_inside_tokens(text: str, ids: list[int], export: Path) -> tuple[str, str]:
    """A stop sequence of the greedy output `ids` that spans a token boundary and ends inside a
    token (not at its end), at its first occurrence; and the text before it."""
    tok, _ = read_hf_tokenizer(export / "tokenizer.json")
    data, bounds = b"", set()
    for i in ids:
        data += tok.token_bytes(i)
        bounds.add(len(data))
    assert data.decode("utf-8", errors="replace") == text  # the bytes `tokenizers` decoded
    for a in range(len(data)):
        for b in range(a + 2, min(a + 7, len(data))):
            try:
                s = data[a:b].decode("utf-8")
            except UnicodeDecodeError:
                continue
            inner = any(a < x < b for x in bounds)
            if s.strip() and inner and b not in bounds and data.find(data[a:b]) == a:
                return s, data[:a].decode("utf-8", errors="replace")
    raise AssertionError(f"no stop sequence inside tokens in {text!r}")


def test_stop_sequences_inside_tokens_cut_the_text_there(served: dict[str, Any]) -> None:
    c = served["client"]
    for prompt in PROMPTS[1:]:
        text, _, _, ids = served["want"][prompt]
        stop, before = _stop_inside_tokens(text, ids, served["export"])
        kw = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        done = c.completions.create(**kw, stop=[stop, "\x00never"])
        assert done.choices[0].finish_reason == "stop", (stop, done.choices[0].text)
        assert done.choices[0].text == before
        chunks = list(c.completions.create(**kw, stop=stop, stream=True))
        assert "".join(p.choices[0].text for p in chunks) == before
        assert chunks[-1].choices[0].finish_reason == "stop"


def _serve_fails(export: Path) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "hpcml", "serve", str(export), "--port", "0"],
        env={**os.environ, "PYTHONPATH": str(SRC)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    return " ".join(proc.stderr.split())


def test_serve_refuses_a_larger_or_malformed_tokenizer(served: dict[str, Any]) -> None:
    export: Path = served["export"]
    bigger = served["tmp"] / "bigger"
    bigger.mkdir()
    for f in ("model.json", "model.safetensors"):
        (bigger / f).write_bytes((export / f).read_bytes())
    big = train_bpe(vocab=480)
    big.save(str(bigger / "tokenizer.json"))
    data = (bigger / "tokenizer.json").read_bytes()
    meta = json.loads((bigger / "model.json").read_text())
    meta["metadata"]["tokenizer"]["sha256"] = hashlib.sha256(data).hexdigest()
    (bigger / "model.json").write_text(json.dumps(meta))
    vocab = meta["args"]["vocab_size"]
    assert f"more than model 'gpt2-small''s vocabulary of {vocab}" in _serve_fails(bigger)
    (bigger / "tokenizer.json").write_text('{"model": ')
    assert "is not valid JSON" in _serve_fails(bigger)
