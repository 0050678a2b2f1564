"""`generation.quantize: int8`: the generation engine runs torchao weight-only int8 Linear
layers. The weights really are int8 (the Linear weights' bytes drop about 4x); continuous
batching still gives every request the tokens of a one-request-at-a-time loop over the *same*
quantized model (weight-only keeps a request independent of its batch); and `hpcml serve` with
the setting answers /v1/completions with that model's greedy text."""

from __future__ import annotations

import copy

import httpx
import pytest
import torch
from gpt_export import save_gpt_export
from tests.unit.generate_util import reference, widen

from hpcml.models.gpt import GPT, GPTConfig
from hpcml.serve.config import ServeConfig
from hpcml.serve.generate.engine import Engine, EngineConfig
from hpcml.serve.generate.quantize import linear_weight_bytes, quantize_int8
from hpcml.serve.generate.sampling import SamplingParams
from hpcml.serve.protocol.app import build_app
from hpcml.serve.testing import running_server

ARGS = {"vocab_size": 256, "max_seq_len": 128, "n_layer": 2, "n_head": 2, "d_model": 64}


def model() -> GPT:
    torch.manual_seed(3)
    m = GPT(GPTConfig(**ARGS)).eval()
    widen(m)  # greedy outputs that depend on the context
    return m


def test_int8_weights_are_int8_and_batching_keeps_the_one_request_tokens() -> None:
    fp32 = model()
    q = quantize_int8(copy.deepcopy(fp32))
    before, after = linear_weight_bytes(fp32), linear_weight_bytes(q)
    # int8 data (1 byte per weight) plus one float32 scale per output row: under a third of
    # float32's 4 bytes per weight for these widths (>= 64 inputs per row).
    assert after < before / 3, (before, after)
    assert q.blocks[0].attn.wq.weight.qdata.dtype == torch.int8  # type: ignore[union-attr]
    assert q.emb.tok.weight.dtype == torch.float32  # the lookup table stays float
    prompts = [[5, 9, 200, 17], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [42], [100, 7, 7]]
    engine = Engine(q, EngineConfig(kv_cache_blocks=32, block_size=4, max_num_seqs=3))
    got = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0))
    want = [reference(q, p, 12) for p in prompts]
    assert got == want
    # And it is another model than float32 (else this test could not tell).
    with torch.no_grad():
        x = torch.tensor([prompts[1]])
        assert not torch.equal(q(x), fp32(x))


@pytest.mark.slow
def test_serve_with_int8_generation(tmp_path_factory: pytest.TempPathFactory) -> None:
    m = model()
    export = save_gpt_export(tmp_path_factory.mktemp("int8") / "export", m, ARGS)
    cfg = ServeConfig.model_validate(
        {"defaults": {"isolation": "thread"}, "generation": {"quantize": "int8"}}
    )
    q = quantize_int8(copy.deepcopy(m))
    prompt = "def main():"
    want = bytes(reference(q, list(prompt.encode()), 16)).decode("utf-8", errors="replace")
    with running_server(build_app(export, cfg, name="tiny")) as url:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want


def test_bf16_generation_engine_runs_in_bfloat16(tmp_path_factory: pytest.TempPathFactory) -> None:
    """`generation.quantize: bf16` (the LLM benchmark's setting on CPUs with AMX): weights and
    KV cache in bfloat16, and greedy tokens equal a one-request loop over the same bf16 model
    (checked only where every step's top-2 logit gap exceeds bf16's rounding)."""
    from hpcml.models.tokenizer import ByteTokenizer
    from hpcml.serve.generate.engine_process import EngineSpec, build_engine

    m = model()
    export = save_gpt_export(tmp_path_factory.mktemp("bf16") / "export", m, ARGS)
    config = EngineConfig(kv_cache_blocks=32, block_size=4)
    engine = build_engine(EngineSpec("tiny", str(export), config, ByteTokenizer(), quantize="bf16"))
    assert next(engine.model.parameters()).dtype == torch.bfloat16
    assert engine.cache.k.dtype == torch.bfloat16
    prompt = [5, 9, 200, 17]
    got = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0))[0]
    assert got == reference(engine.model, prompt, 6)
