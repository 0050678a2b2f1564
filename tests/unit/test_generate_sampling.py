"""Sampling (greedy, temperature, top-k, top-p, seeds), stop sequences and streaming text."""

from __future__ import annotations

import math
import random

import pytest
import torch
from generate_util import one_thread, reference, tiny_gpt

from hpcml.serve.generate.engine import Engine, EngineConfig
from hpcml.serve.generate.sampling import ByteTokenizer, SamplingParams, TextStream, sample

# Probabilities 0.5, 0.3, 0.15, 0.05 over tokens 3, 1, 0, 2.
PROBS = torch.tensor([0.15, 0.3, 0.05, 0.5], dtype=torch.float64)
LOGITS = PROBS.log()


def counts(params: SamplingParams, draws: int = 4000) -> list[int]:
    g = params.generator()
    seen = [0] * 4
    for _ in range(draws):
        seen[sample(LOGITS, params, g)] += 1
    return seen


def test_temperature_one_draws_from_the_softmax() -> None:
    seen = counts(SamplingParams(temperature=1.0, seed=0))
    for k in range(4):
        p = float(PROBS[k])
        # Binomial count: 4.5 standard deviations (a fixed seed makes it deterministic anyway;
        # a sampler off by 0.03 in any probability moves its count by more than this).
        assert abs(seen[k] - 4000 * p) < 4.5 * math.sqrt(4000 * p * (1 - p)), seen


def test_low_temperature_sharpens_and_zero_is_greedy() -> None:
    sharp = counts(SamplingParams(temperature=0.25, seed=1))
    # p^(1/T) normalised: 0.5^4 / sum = 0.878 for token 3.
    assert 0.85 * 4000 < sharp[3] < 0.91 * 4000
    assert counts(SamplingParams(temperature=0.0), draws=50) == [0, 0, 0, 50]


def test_top_k_and_top_p_keep_only_the_most_likely_tokens() -> None:
    top2 = counts(SamplingParams(top_k=2, seed=2))
    assert top2[0] == top2[2] == 0 and min(top2[1], top2[3]) > 0
    # Renormalised over {3, 1}: 0.5 / 0.8 = 0.625 for token 3 (4.5 sigma as above).
    assert abs(top2[3] - 2500) < 4.5 * math.sqrt(4000 * 0.625 * 0.375)
    # top_p 0.75: 3 (0.5) is kept, 1 is kept (the tokens before it reach 0.5 < 0.75), 0 is
    # dropped (the tokens before it reach 0.8 >= 0.75).
    nucleus = counts(SamplingParams(top_p=0.75, seed=3))
    assert nucleus[0] == nucleus[2] == 0 and min(nucleus[1], nucleus[3]) > 0
    assert counts(SamplingParams(top_p=0.4, seed=4), draws=200) == [0, 0, 0, 200]


pytestmark = pytest.mark.usefixtures(one_thread.__name__)

MODEL = tiny_gpt(seed=1, vocab=256)


def run_alone(prompt: list[int], params: SamplingParams) -> list[int]:
    engine = Engine(MODEL, EngineConfig(kv_cache_blocks=64, block_size=4))
    return engine.generate([prompt], params)[0]


def test_a_seed_makes_sampling_reproducible_whatever_is_batched_with_it() -> None:
    """Float64 model: batching changes logits by ~1e-15 relative, so a draw flips only if a
    uniform number lands within ~1e-15 of a cumulative-probability boundary (chance ~1e-13)."""
    params = SamplingParams(max_tokens=12, temperature=1.5, seed=42)
    alone = run_alone([5, 6, 7], params)
    assert alone == run_alone([5, 6, 7], params)
    # Overcommitted, so that all run together and preemption happens.
    config = EngineConfig(kv_cache_blocks=12, block_size=2, max_num_seqs=3, kv_overcommit=4.0)
    engine = Engine(MODEL, config)
    rng = random.Random(0)
    others = [[rng.randrange(256) for _ in range(9)] for _ in range(3)]
    ids = [engine.submit(p, SamplingParams(max_tokens=12, temperature=1.5)) for p in others]
    mine = engine.submit([5, 6, 7], params)
    out: dict[int, list[int]] = {}
    while engine.has_work:
        for ev in engine.step():
            assert ev.token is not None
            out.setdefault(ev.seq_id, []).append(ev.token)
    assert engine.preemptions > 0  # a cache of 24 slots for 4 x ~21 tokens
    assert out[mine] == alone and len(ids) == 3
    other_seed = run_alone([5, 6, 7], SamplingParams(max_tokens=12, temperature=1.5, seed=43))
    assert other_seed != alone


def test_stop_sequences_and_max_tokens_end_generation() -> None:
    prompt = list(b"def ")
    greedy = reference(MODEL, prompt, 12)
    stop = bytes(greedy[4:6])
    # The stop sequence must not occur earlier in the output for this check to be exact.
    assert stop not in bytes(greedy[:5])
    engine = Engine(MODEL, EngineConfig(kv_cache_blocks=64, block_size=4))
    sid = engine.submit(
        prompt, SamplingParams(max_tokens=12, temperature=0, stop=(b"\xff\xfe", stop))
    )
    events = []
    while engine.has_work:
        events += engine.step()
    assert [ev.token for ev in events] == greedy[:6]
    assert events[-1].finish_reason == "stop" and events[-1].stopped_by == stop
    assert all(ev.seq_id == sid for ev in events)
    text = TextStream((b"\xff\xfe", stop))
    streamed = "".join(text.push(t) for t in greedy[:6]) + text.finish(stop)
    assert streamed == ByteTokenizer().decode(greedy[:4])
    assert run_alone(prompt, SamplingParams(max_tokens=5, temperature=0)) == greedy[:5]


def test_text_stream_never_splits_a_character_nor_leaks_a_stop_sequence() -> None:
    source = "héllo ✓ wörld END tail"
    data = source.encode("utf-8")
    stream = TextStream((b"END",))
    deltas = []
    for i, byte in enumerate(data):
        deltas.append(stream.push(byte))
        if data[: i + 1].endswith(b"END"):
            deltas.append(stream.finish(b"END"))
            break
    assert "".join(deltas) == "héllo ✓ wörld "
    assert all("\ufffd" not in d for d in deltas)
    assert "E" not in "".join(deltas)
    # Without stop sequences every complete character goes out at once.
    plain = TextStream()
    assert [plain.push(b) for b in "é".encode()] == ["", "é"]
    assert ByteTokenizer().encode("é") == [195, 169]
