"""The attention of a decode step costs in proportion to the sum of the contexts.

The work is counted, not timed: a `TorchFunctionMode` sees every
`scaled_dot_product_attention` call the model makes during one step and adds up the key
positions each one attends (batch x keys), independent of the code that groups the sequences.
Before sequences were bucketed by context, every decode was padded to the longest context of
the step: one 1500-token context among 31 short ones made every sequence attend (and gather)
1504 keys, 16x the sum of the contexts. Step *times* are measured by
benchmarks/llm_attention.py.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from generate_util import one_thread, reference, tiny_gpt
from torch.overrides import TorchFunctionMode

from hpcml.models.gpt import GPT, GPTConfig
from hpcml.serve.generate import kv_cache
from hpcml.serve.generate.engine import Engine, EngineConfig
from hpcml.serve.generate.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures(one_thread.__name__)


class KeysAttended(TorchFunctionMode):
    """Adds up batch x key positions over the attention calls it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.keys = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is F.scaled_dot_product_attention:
            key = args[1]
            self.keys += key.shape[0] * key.shape[-2]
        return func(*args, **(kwargs or {}))


def decode_step_keys(contexts: list[int]) -> tuple[int, int]:
    """Key positions attended per layer by one decode step of sequences with these contexts
    (prompts of those lengths, prefilled first), and the sum of their contexts."""
    cfg = GPTConfig(vocab_size=64, max_seq_len=1600, n_layer=2, n_head=2, d_model=16)
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    block = 16
    need = sum(-(-(c + 4) // block) for c in contexts)
    config = EngineConfig(
        kv_cache_blocks=2 * need, block_size=block, max_num_seqs=64, max_batched_tokens=4096
    )
    engine = Engine(model, config)
    rng = random.Random(0)
    for c in contexts:
        engine.submit([rng.randrange(64) for _ in range(c)], SamplingParams(max_tokens=4))
    engine.step()  # every prefill in one step; each sequence ends with its first token
    assert len(engine.running) == len(contexts)
    assert all(len(s.tokens) - s.computed == 1 for s in engine.running)
    with KeysAttended() as seen:
        engine.step()  # one decode step of every sequence
    return seen.keys // cfg.n_layer, sum(c + 1 for c in contexts)


def test_one_long_context_does_not_pad_every_decode_to_its_length() -> None:
    short, mixed = [48] * 32, [1500] + [48] * 31
    short_keys, short_sum = decode_step_keys(short)
    mixed_keys, mixed_sum = decode_step_keys(mixed)
    # Keys are gathered in whole blocks of 16: each context rounds up by less than a block.
    assert short_keys <= short_sum + 32 * 16
    # The allowance, on work: the long context may cost 1.5x its extra positions.
    assert mixed_keys - short_keys <= 1.5 * (mixed_sum - short_sum), (mixed_keys, short_keys)


def test_bucketed_attention_keeps_greedy_outputs_equal_to_full_recompute(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With no cost per group, every split that saves padding happens (several groups of
    decodes and of prompt chunks per step): outputs still equal one-at-a-time recompute."""
    monkeypatch.setattr(kv_cache, "GROUP_COST_POSITIONS", 0)
    model = tiny_gpt(seed=3)
    rng = random.Random(3)
    prompts = [[rng.randrange(64) for _ in range(rng.randint(1, 24))] for _ in range(8)]
    engine = Engine(model, EngineConfig(kv_cache_blocks=80, block_size=4, max_batched_tokens=20))
    groups = []
    real = kv_cache.buckets

    def spy(items: Any, block_size: int) -> Any:
        out = real(items, block_size)
        groups.append(len(out))
        return out

    monkeypatch.setattr(kv_cache, "buckets", spy)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0))
    assert max(groups) > 1  # the split did happen
    for out, prompt in zip(outputs, prompts, strict=True):
        assert out == reference(model, prompt, 12)
