"""Shared by the generation tests: a tiny float64 gpt and the full-recompute reference."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from hpcml.models.gpt import GPT, GPTConfig

MARGIN = 1e-9
"""Smallest allowed gap between the best and second logit of the reference (see docstring)."""

CONTEXT = 40


def tiny_gpt(seed: int = 0, vocab: int = 64) -> GPT:
    torch.manual_seed(seed)
    cfg = GPTConfig(
        vocab_size=vocab,
        max_seq_len=CONTEXT,
        n_layer=2,
        n_head=2,
        d_model=32,
        vocab_multiple=64,
        tie_embeddings=False,
    )
    model = GPT(cfg).double().eval()
    widen(model)
    return model


def widen(model: GPT) -> None:
    """GPT-2's init (std 0.02, tied embeddings) makes a random model repeat one token whatever
    the context; untied, with weights of std 0.3 (norms kept), its greedy outputs vary from
    token to token and depend on the whole context, so a wrong cached key changes them."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.3)


def reference(model: GPT, prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(max_tokens):
            logits = model(torch.tensor([tokens]))[0, -1]
            top2 = torch.topk(logits, 2).values
            assert float(top2[0] - top2[1]) > MARGIN, "near-tie in the reference: pick another seed"
            tokens.append(int(torch.argmax(logits)))
    return tokens[len(prompt) :]


def served_reference(model: GPT, prompt: str, max_tokens: int) -> str:
    """The text a float32 server must answer for a greedy request: full recompute per token.
    The server batches, so its logits differ from these by rounding only (see
    tests/integration/test_serve_generate.py for the bound); the range and the 1e-3 gap between
    the best two logits are asserted so no rounding difference can flip a token."""
    tokens = list(prompt.encode("utf-8"))
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(max_tokens):
            logits = model(torch.tensor([tokens + out]))[0, -1]
            assert float(logits.abs().max()) < 10, "logits outside the range the bound assumes"
            top2 = torch.topk(logits, 2).values
            assert float(top2[0] - top2[1]) > 1e-3, "near-tie in the reference"
            out.append(int(torch.argmax(logits)))
    return bytes(out).decode("utf-8", errors="replace")


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny matrices: one intra-op thread is several times faster than two on a busy 2-core
    machine (no thread handoff per kernel); restored afterwards for the other tests."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
