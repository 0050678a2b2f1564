"""GPT-2 weights saved by Hugging Face `transformers` (a tiny randomly initialised
GPT2LMHeadModel, `save_pretrained` to config.json + model.safetensors) imported into hpcml's
gpt: the same logits as transformers' own forward, the same greedy tokens as its `generate`
through hpcml's paged, continuously batched engine, and `hpcml model import-hf` writes an
export `hpcml serve` loads. Refusals are one sentence.

The checks fail if a Conv1D weight is not transposed, q/k/v are split in another order, a
LayerNorm or bias is dropped or swapped (every parameter is perturbed with seeded noise, so
none holds its default 1 or 0), or the vocabulary padding shifts a row (vocab 300 is not a
multiple of 64)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from typer.testing import CliRunner

from hpcml.cli.app import app
from hpcml.errors import ConfigError
from hpcml.models.export import load_export
from hpcml.models.hf_gpt2 import import_gpt2
from hpcml.serve.generate.engine import Engine, EngineConfig
from hpcml.serve.generate.sampling import SamplingParams

VOCAB = 300


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    folder = tmp_path_factory.mktemp("hf") / "gpt2-tiny"
    model.save_pretrained(folder)  # safetensors by default
    assert (folder / "model.safetensors").is_file()
    return folder


def _hf(folder: Path) -> transformers.GPT2LMHeadModel:
    return transformers.GPT2LMHeadModel.from_pretrained(folder).eval().double()


def test_logits_equal_transformers(hf_folder: Path) -> None:
    ours, args = import_gpt2(hf_folder)
    assert args["vocab_size"] == VOCAB and args["d_model"] == 32
    ours = ours.double()
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = _hf(hf_folder)(ids).logits
        got = ours(ids)[..., :VOCAB]
    # float64 on both sides; the only differences are the order of sums (fused vs split q/k/v,
    # SDPA vs HF's attention), of order 1e-15 relative on logits of order 1.
    assert torch.allclose(got, want, rtol=0, atol=1e-10), (got - want).abs().max()


def test_greedy_tokens_equal_transformers_generate(hf_folder: Path) -> None:
    ours, _ = import_gpt2(hf_folder)
    ours = ours.double()
    prompts = [[5, 17, 250, 3], [299, 0, 42, 42, 42, 7, 1], [100]]
    hf = _hf(hf_folder)
    want = []
    for p in prompts:
        out = hf.generate(
            torch.tensor([p]),
            max_new_tokens=10,
            do_sample=False,
            pad_token_id=0,
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
        )
        want.append(out[0, len(p) :].tolist())
    engine = Engine(ours, EngineConfig(kv_cache_blocks=16, block_size=4))
    got = engine.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0))
    assert got == want


def test_import_hf_writes_a_servable_export(hf_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "export"
    res = CliRunner().invoke(app, ["model", "import-hf", str(hf_folder), "--out", str(out)])
    assert res.exit_code == 0, res.output
    meta = json.loads((out / "model.json").read_text())
    assert meta["architecture"] == "gpt2-small" and meta["task"] == "language_modeling"
    model, _ = load_export(out)
    ours, _ = import_gpt2(hf_folder)
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(model(ids), ours(ids))
    # An existing --out is never overwritten.
    again = CliRunner().invoke(app, ["model", "import-hf", str(hf_folder), "--out", str(out)])
    assert again.exit_code == 2 and "already exists" in again.stderr


def test_what_cannot_import_is_one_sentence(hf_folder: Path, tmp_path: Path) -> None:
    cfg = json.loads((hf_folder / "config.json").read_text())
    for change, words in (
        ({"model_type": "llama"}, "only GPT-2-shaped"),
        ({"activation_function": "relu"}, "activation_function"),
        ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ):
        bad = tmp_path / words.replace(" ", "_")
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps({**cfg, **change}))
        (bad / "model.safetensors").write_bytes((hf_folder / "model.safetensors").read_bytes())
        with pytest.raises(ConfigError, match=words):
            import_gpt2(bad)
    pickled = tmp_path / "bin-only"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps(cfg))
    (pickled / "pytorch_model.bin").write_bytes(b"not read")
    res = CliRunner().invoke(
        app, ["model", "import-hf", str(pickled), "--out", str(tmp_path / "o")]
    )
    assert res.exit_code == 2 and "pickle and is not read" in res.stderr
    assert "Traceback" not in res.output
