"""Admission and preemption under a tight KV cache: the work recomputed stays bounded.

Seeded workloads of requests that together need several times the cache run through the
engine with its default admission settings. The positions the model computes are counted by a
forward hook on the model (independent of the engine's own bookkeeping) and compared with the
ideal: every prompt and output position computed once (`prompt + max_tokens - 1`: the last
token is sampled, never fed back). Before admission took whole prefills and projected lengths
into account, a sequence was admitted when its next chunk fitted, and growing sequences
preempted each other over and over (the issue measured 3.12x the ideal positions and one
sequence preempted 25 times). Greedy outputs must still equal one-at-a-time full recompute.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from generate_util import CONTEXT, one_thread, reference, tiny_gpt

from hpcml.serve.generate.engine import Engine, EngineConfig, Sequence
from hpcml.serve.generate.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

MODEL = tiny_gpt()
BOUND = 1.3
"""The issue's goal: at most 30% more positions than the ideal. With the default
`kv_overcommit` (1.25) the running sequences at their longest need at most 1.25x the cache, so
preemption discards a fraction of the work, and each sequence at most `max_preemptions` times."""
MAX_PREEMPTIONS = 2
"""`EngineConfig.max_preemptions`' default: "no sequence preempted more than a few times"."""


def workload(seed: int) -> tuple[EngineConfig, list[tuple[list[int], int]]]:
    """6 to 12 requests that together need 2x to 6x a cache which fits the longest alone."""
    rng = random.Random(seed)
    requests = []
    for _ in range(rng.randint(6, 12)):
        prompt = [rng.randrange(64) for _ in range(rng.randint(2, 16))]
        requests.append((prompt, rng.randint(4, CONTEXT - 16)))
    block_size = rng.choice([2, 4])
    blocks = [-(-(len(p) + m) // block_size) for p, m in requests]
    size = rng.randint(max(blocks), max(max(blocks), sum(blocks) // 2))
    return EngineConfig(kv_cache_blocks=size, block_size=block_size), requests


def run(config: EngineConfig, requests: list[tuple[list[int], int]]) -> tuple[int, list[Sequence]]:
    """Positions computed (counted by a hook on the model) and the sequences, run to the end;
    every output checked against one-at-a-time full recompute."""
    engine = Engine(MODEL, config)
    computed = [0]

    def count(_: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        computed[0] += args[0].numel()  # the step's token ids: one per position computed

    hook = MODEL.register_forward_pre_hook(count)
    try:
        seqs: list[Sequence] = []
        for prompt, max_tokens in requests:
            engine.submit(prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
            seqs.append(engine.waiting[-1])
        while engine.has_work:
            engine.step()
            # A step that plans nothing changes nothing: the engine would spin forever.
            assert engine.batch_size, "the engine has work but planned none (stuck)"
    finally:
        hook.remove()
    for seq, (prompt, max_tokens) in zip(seqs, requests, strict=True):
        assert seq.output == reference(MODEL, prompt, max_tokens)
    assert engine.cache.allocator.free == config.kv_cache_blocks
    return computed[0], seqs


@pytest.mark.parametrize("seed", range(12))
def test_tight_kv_recomputes_little_and_preempts_each_sequence_a_few_times(seed: int) -> None:
    config, requests = workload(seed)
    computed, seqs = run(config, requests)
    ideal = sum(len(p) + m - 1 for p, m in requests)
    assert computed <= BOUND * ideal, (computed, ideal, config)
    assert max(s.preemptions for s in seqs) <= MAX_PREEMPTIONS


@pytest.mark.parametrize("seed", range(4))
def test_an_overcommitted_cache_still_bounds_each_sequences_preemptions(seed: int) -> None:
    """Admission told to overcommit 4x (so preemption happens: 4 to 6 per workload on these
    seeds): each sequence is still preempted at most `max_preemptions` times, then readmitted
    with blocks for its longest length."""
    config, requests = workload(seed)
    config = dataclasses.replace(config, kv_overcommit=4.0, max_preemptions=1)
    _, seqs = run(config, requests)
    assert sum(s.preemptions for s in seqs) > len(seqs) // 4  # preemption did happen
    assert max(s.preemptions for s in seqs) == 1


@pytest.mark.parametrize("overcommit", [1.0, 1.25])
@pytest.mark.parametrize("blocks", [8, 25], ids=["cache-under-context", "cache-2.5-contexts"])
def test_max_tokens_null_requests_submitted_together_all_finish(
    blocks: int, overcommit: float
) -> None:
    """`max_tokens: null` asks for the rest of the context or of the cache (what the OpenAI
    endpoints' `room` gives), so each such sequence at its longest needs up to the whole cache.
    Admission must neither refuse them nor wait forever for an overcommit budget they can never
    fit in together: the first runs alone, the others as their longest lengths allow; all end
    by length with the full-recompute outputs, and the cache is empty at the end."""
    config = EngineConfig(kv_cache_blocks=blocks, block_size=4, kv_overcommit=overcommit)
    room = min(CONTEXT, blocks * 4)
    rng = random.Random(blocks)
    prompts = [[rng.randrange(64) for _ in range(n)] for n in (3, 5, 8, 2)]
    requests = [(p, room - len(p)) for p in prompts]
    _, seqs = run(config, requests)
    assert [s.finish_reason for s in seqs] == ["length"] * 4
    assert [len(s.output) for s in seqs] == [m for _, m in requests]
