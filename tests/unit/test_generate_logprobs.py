"""Logprobs (generated and prompt tokens) and presence/frequency penalties in the engine: equal
to one full-recompute forward pass of the float64 model, through chunked prefill, preemption
and prefix sharing."""

from __future__ import annotations

import pytest
import torch
from generate_util import one_thread, tiny_gpt

from hpcml.serve.generate.engine import Engine, EngineConfig, TokenEvent
from hpcml.serve.generate.sampling import SamplingParams, penalize, sample

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

MODEL = tiny_gpt(seed=3, vocab=64)
TOL = 1e-9
"""Float64 model: batched, paged attention differs from one full pass by ~1e-15 relative."""


def full_logprobs(tokens: list[int]) -> torch.Tensor:
    """log_softmax of one forward pass over `tokens`: row p predicts token p + 1."""
    with torch.inference_mode():
        return torch.log_softmax(MODEL(torch.tensor([tokens]))[0, :, :64].double(), dim=-1)


def run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> dict[int, list]:
    ids = [engine.submit(p, params) for p in prompts]
    events: dict[int, list[TokenEvent]] = {i: [] for i in ids}
    while engine.has_work:
        for ev in engine.step():
            events[ev.seq_id].append(ev)
    return events


@pytest.mark.parametrize(
    "config",
    [
        EngineConfig(kv_cache_blocks=64, block_size=4),
        # 4-token chunks: a prompt's logprobs come from several steps.
        EngineConfig(kv_cache_blocks=64, block_size=4, max_batched_tokens=4),
        # 9 blocks of 2 for 3 x ~16 tokens, admission overcommitted 4x (1.25x, the default,
        # admits these one at a time): sequences are preempted and recomputed.
        EngineConfig(kv_cache_blocks=9, block_size=2, max_num_seqs=3, kv_overcommit=4.0),
    ],
    ids=["one-step", "chunked", "preempted"],
)
def test_prompt_and_token_logprobs_equal_one_full_pass(config: EngineConfig) -> None:
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 5, 6, 7, 8, 11], [20, 21, 22, 23]]
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=3, prompt_logprobs=2)
    engine = Engine(MODEL, config)
    # A shared prefix must not skip the positions whose prompt logprobs are asked for.
    engine.generate([prompts[0]], SamplingParams(max_tokens=1, temperature=0))
    events = run(engine, prompts, params)
    for prompt, evs in zip(prompts, events.values(), strict=True):
        out = [ev.token for ev in evs]
        full = full_logprobs(prompt + out)
        got = evs[0].prompt_logprobs
        assert got is not None and [t for t, _, _ in got] == prompt[1:]
        for p, (token, lp, top) in enumerate(got):
            assert abs(lp - float(full[p, token])) < TOL
            best = torch.topk(full[p], 2)
            assert [t for t, _ in top] == best.indices.tolist()
            assert max(abs(v - float(w)) for (_, v), w in zip(top, best.values, strict=True)) < TOL
        assert all(ev.prompt_logprobs is None for ev in evs[1:])
        for i, ev in enumerate(evs):
            assert ev.logprob is not None
            token, lp, top = ev.logprob
            row = full[len(prompt) - 1 + i]
            assert token == ev.token == int(torch.argmax(row)) == top[0][0]
            assert lp == top[0][1] and abs(lp - float(row[token])) < TOL and len(top) == 3
    if config.kv_cache_blocks == 9:
        assert engine.preemptions > 0


def test_penalties_lower_the_logits_of_tokens_already_generated() -> None:
    logits = torch.zeros(5, dtype=torch.float64)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    # Token 1 twice, token 3 once: 1 loses 0.5 + 2 x 0.25, 3 loses 0.5 + 0.25.
    assert penalize(logits, params, [1, 3, 1]).tolist() == [0.0, -1.0, 0.0, -0.75, 0.0]
    greedy = SamplingParams(temperature=0, presence_penalty=2.0)
    assert sample(torch.tensor([3.0, 2.0, 0.0]), greedy, None, [0]) == 1
    # Through the engine: a strong presence penalty never repeats a token a greedy run would.
    engine = Engine(MODEL, EngineConfig(kv_cache_blocks=64, block_size=4))
    plain = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=20, temperature=0))[0]
    assert len(set(plain)) < len(plain)  # the plain greedy run repeats itself
    penalized = SamplingParams(max_tokens=20, temperature=0, presence_penalty=2.0)
    out = engine.generate([[5, 6, 7]], penalized)[0]
    assert len(set(out)) == len(out)


def test_a_step_mixing_prompt_logprobs_and_plain_requests_reads_each_ones_logits() -> None:
    """The model computes LM-head logits only for the rows read: a chunk's last row, or all of
    a chunk's rows when its request asks for prompt logprobs. In one step with both kinds (and
    chunked prefill, 4 tokens a step), each sequence must read its own rows: greedy outputs
    equal a full pass, and the prompt logprobs equal a full pass's."""
    engine = Engine(MODEL, EngineConfig(kv_cache_blocks=64, block_size=4, max_batched_tokens=9))
    plain = SamplingParams(max_tokens=5, temperature=0)
    scored = SamplingParams(max_tokens=5, temperature=0, prompt_logprobs=0)
    prompts = [[3, 1, 4, 1, 5, 9, 2], [6, 5, 3, 5, 8, 9, 7, 9], [2, 7, 1, 8, 2, 8]]
    ids = [engine.submit(p, s) for p, s in zip(prompts, (plain, scored, plain), strict=True)]
    events: dict[int, list[TokenEvent]] = {i: [] for i in ids}
    while engine.has_work:
        for ev in engine.step():
            events[ev.seq_id].append(ev)
    for prompt, i in zip(prompts, ids, strict=True):
        out = [ev.token for ev in events[i]]
        full = full_logprobs(prompt + out)
        assert out == [int(torch.argmax(full[len(prompt) - 1 + j])) for j in range(5)]
    got = events[ids[1]][0].prompt_logprobs
    full = full_logprobs(prompts[1])
    assert got is not None and len(got) == len(prompts[1]) - 1
    assert max(abs(lp - float(full[p, t])) for p, (t, lp, _) in enumerate(got)) < TOL
