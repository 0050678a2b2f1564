"""The generation engine against the plainest possible generator, token for token.

Greedy outputs of the continuous-batching engine over the paged KV cache must equal, for every
request, a loop that runs the model on the request's whole prefix for every new token (no
cache, no batching). Hypothesis draws arrival patterns, batch limits, block sizes and caches
small enough to force preemptions.

Ties: batched and single forwards add in different orders, so logits may differ in the last
bits and a near-tie of the two best tokens could flip the argmax. The model runs in float64
(rounding errors ~1e-15 of the logits' size) and the reference asserts at every step that the
best logit beats the second by more than 1e-9, so a tie would fail as a test-setup problem on
the reference side, never as a silent flake; with a derandomized Hypothesis the examples are
the same on every run.
"""

from __future__ import annotations

import random

import pytest
from generate_util import one_thread, reference, tiny_gpt
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpcml.serve.generate.engine import Engine, EngineConfig, RequestRefused, StepStats
from hpcml.serve.generate.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

MODEL = tiny_gpt()


def run_engine(engine: Engine, requests: list[tuple[list[int], int, int]]) -> dict[int, list[int]]:
    """Submit each (prompt, max_tokens, arrival_step) when its step comes; run to the end."""
    pending = sorted(range(len(requests)), key=lambda i: requests[i][2])
    ids: dict[int, int] = {}
    out: dict[int, list[int]] = {}
    step = 0
    while pending or engine.has_work:
        while pending and requests[pending[0]][2] <= step:
            i = pending.pop(0)
            prompt, max_tokens, _ = requests[i]
            ids[engine.submit(prompt, SamplingParams(max_tokens=max_tokens, temperature=0))] = i
        for ev in engine.step():
            assert ev.token is not None
            out.setdefault(ids[ev.seq_id], []).append(ev.token)
        step += 1
        assert step < 10_000, "the engine stopped making progress"
    return out


@st.composite
def workloads(draw: st.DrawFn) -> tuple[EngineConfig, list[tuple[list[int], int, int]]]:
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    n = draw(st.integers(1, 7))
    requests = []
    for _ in range(n):
        prompt = [rng.randrange(64) for _ in range(rng.randint(1, 20))]
        requests.append((prompt, rng.randint(1, 12), rng.choice([0, 0, 1, 2, 5, 9])))
    block_size = draw(st.sampled_from([1, 2, 3, 4, 8]))
    # From just enough for the longest request alone (forces preemption) to plenty.
    need = max(-(-(len(p) + m) // block_size) for p, m, _ in requests)
    blocks = draw(st.integers(need, 3 * need))
    config = EngineConfig(
        kv_cache_blocks=blocks,
        block_size=block_size,
        max_num_seqs=draw(st.integers(1, 6)),
        max_batched_tokens=draw(st.sampled_from([2, 5, 64])),
        max_prefill_tokens=draw(st.sampled_from([None, 1, 3, 32])),
        # From admission that never preempts to one that lets preemption happen often.
        kv_overcommit=draw(st.sampled_from([1.0, 1.25, 4.0])),
        max_preemptions=draw(st.integers(1, 3)),
        watermark_blocks=draw(st.integers(0, 2)),
    )
    return config, requests


@settings(
    max_examples=40,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(workloads())
def test_greedy_outputs_equal_one_request_at_a_time_full_recompute(
    workload: tuple[EngineConfig, list[tuple[list[int], int, int]]],
) -> None:
    config, requests = workload
    engine = Engine(MODEL, config)
    got = run_engine(engine, requests)
    for i, (prompt, max_tokens, _) in enumerate(requests):
        assert got[i] == reference(MODEL, prompt, max_tokens), f"request {i} of {config}"
    # Every block is back on the free list; nothing is left running.
    assert engine.cache.allocator.free == config.kv_cache_blocks
    assert not engine.running and not engine.waiting


def test_a_cache_too_small_for_all_preempts_and_still_matches() -> None:
    """Four requests of 30 tokens, a cache of 32 token slots: they start together (short
    prompts) and cannot all grow to their end."""
    rng = random.Random(7)
    requests = [([rng.randrange(64) for _ in range(4)], 26, 0) for _ in range(4)]
    # Overcommitted 4x, so that admission lets them all in and preemption has to happen.
    config = EngineConfig(kv_cache_blocks=8, block_size=4, max_num_seqs=4, kv_overcommit=4.0)
    engine = Engine(MODEL, config)
    got = run_engine(engine, requests)
    assert engine.preemptions > 0
    for i, (prompt, max_tokens, _) in enumerate(requests):
        assert got[i] == reference(MODEL, prompt, max_tokens)


def test_sequences_join_and_leave_the_batch_at_every_step() -> None:
    """A request arriving while another decodes is computed in the same forward passes, and a
    short request leaves while the long one goes on (continuous, not static batching)."""
    engine = Engine(MODEL, EngineConfig(kv_cache_blocks=64, block_size=4))
    long_id = engine.submit([1, 2, 3], SamplingParams(max_tokens=20, temperature=0))
    engine.step()  # prefill of the long one, first token
    short_id = engine.submit([4, 5], SamplingParams(max_tokens=2, temperature=0))
    batches = []
    while engine.has_work:
        batches.append({ev.seq_id for ev in engine.step()})
    assert batches[0] == {long_id, short_id}  # admitted at the very next step
    assert batches[1] == {long_id, short_id}
    assert all(b == {long_id} for b in batches[2:]) and len(batches) == 19


def test_static_batching_gives_the_same_tokens_later() -> None:
    rng = random.Random(3)
    requests = [([rng.randrange(64) for _ in range(5)], m, 0) for m in (2, 9, 4)]
    late = ([9, 8, 7], 3)
    cfg = EngineConfig(kv_cache_blocks=64, block_size=4, max_num_seqs=3, static_batching=True)
    static = Engine(MODEL, cfg)
    ids = [static.submit(p, SamplingParams(max_tokens=m, temperature=0)) for p, m, _ in requests]
    out: dict[int, list[int]] = {}
    steps: dict[int, list[int]] = {}
    step = 0
    late_id = -1
    while static.has_work:
        for ev in static.step():
            assert ev.token is not None
            out.setdefault(ev.seq_id, []).append(ev.token)
            steps.setdefault(ev.seq_id, []).append(step)
        if step == 0:
            late_id = static.submit(late[0], SamplingParams(max_tokens=late[1], temperature=0))
        step += 1
    for i, (prompt, max_tokens, _) in zip(ids, requests, strict=True):
        assert out[i] == reference(MODEL, prompt, max_tokens)
    # The late request waits for the longest of the batch (9 tokens), then runs alone.
    assert steps[late_id][0] == max(steps[ids[1]]) + 1 == 9
    assert out[late_id] == reference(MODEL, late[0], late[1])
    assert static.cache.allocator.free == 64


@pytest.mark.parametrize("static", [False, True])
def test_positions_computed_count_prompts_decodes_and_static_padding(static: bool) -> None:
    """What the benchmark's work ratio rests on, counted by hand: prompts of 3 and 4 tokens
    (7 positions in the first step), then one decode for the 2-token request and four for the
    5-token one (a request's last token is never fed back): 12. Static batching also runs the
    finished request as padding beside each of the long one's last three decodes: 15."""
    engine = Engine(MODEL, EngineConfig(kv_cache_blocks=64, block_size=4, static_batching=static))
    engine.submit([1, 2, 3], SamplingParams(max_tokens=2, temperature=0))
    engine.submit([4, 5, 6, 7], SamplingParams(max_tokens=5, temperature=0))
    while engine.has_work:
        engine.step()
    assert engine.rows_computed == (15 if static else 12)


def test_requests_that_can_never_fit_are_refused_at_submit() -> None:
    engine = Engine(MODEL, EngineConfig(kv_cache_blocks=4, block_size=4))
    with pytest.raises(RequestRefused, match="context of 40"):
        engine.submit([1] * 30, SamplingParams(max_tokens=11))
    with pytest.raises(RequestRefused, match="exceeds the KV cache"):
        engine.submit([1] * 10, SamplingParams(max_tokens=7))
    with pytest.raises(RequestRefused, match="empty"):
        engine.submit([], SamplingParams())
    assert not engine.has_work


def test_chunked_prefill_does_not_stall_decoding() -> None:
    """With 4 tokens per step, a 30-token prompt is prefilled 3 tokens a step beside a decode,
    which keeps getting one token every step."""
    engine = Engine(MODEL, EngineConfig(kv_cache_blocks=64, block_size=4, max_batched_tokens=4))
    a = engine.submit([1, 2], SamplingParams(max_tokens=20, temperature=0))
    engine.step()
    prompt = [random.Random(5).randrange(64) for _ in range(30)]
    b = engine.submit(prompt, SamplingParams(max_tokens=3, temperature=0))
    per_step = [[ev.seq_id for ev in engine.step()] for _ in range(10)]
    assert all(a in ids for ids in per_step)  # a decodes at every step
    assert [b in ids for ids in per_step] == [False] * 9 + [True]  # ceil(30 / 3) steps
    while engine.has_work:
        engine.step()
    assert engine.cache.allocator.free == 64


def test_prompt_tokens_per_step_are_capped_only_while_others_decode() -> None:
    """`max_prefill_tokens` 4: beside a decoding sequence a 30-token prompt takes 4 tokens a
    step (5 positions per step, its first token at step ceil(30 / 4) = 8), although
    `max_batched_tokens` 64 would take it whole; alone (nothing decodes) it is prefilled whole
    in one step."""
    cfg = EngineConfig(
        kv_cache_blocks=64, block_size=4, max_batched_tokens=64, max_prefill_tokens=4
    )
    engine = Engine(MODEL, cfg)
    a = engine.submit([1, 2], SamplingParams(max_tokens=20, temperature=0))
    engine.step()
    prompt = [random.Random(6).randrange(64) for _ in range(30)]
    b = engine.submit(prompt, SamplingParams(max_tokens=3, temperature=0))
    rows, per_step = [], []
    for _ in range(8):
        before = engine.rows_computed
        per_step.append([ev.seq_id for ev in engine.step()])
        rows.append(engine.rows_computed - before)
    assert all(a in ids for ids in per_step)
    assert [b in ids for ids in per_step] == [False] * 7 + [True]
    assert rows == [5] * 7 + [3]
    alone = Engine(MODEL, cfg)
    c = alone.submit(prompt, SamplingParams(max_tokens=3, temperature=0))
    assert [ev.seq_id for ev in alone.step()] == [c]
    assert alone.rows_computed == 30


def test_last_step_counts_decodes_prompt_tokens_and_padding() -> None:
    """`Engine.last_step` (what the step profile benchmark reads): a 3-token prompt's prefill is
    3 prompt tokens and no decode; its decodes beside a 4-token prompt are 1 decode and 4 prompt
    tokens; under static batching a finished sequence is 1 padding row per step."""
    engine = Engine(MODEL, EngineConfig(kv_cache_blocks=64, block_size=4))
    engine.submit([1, 2, 3], SamplingParams(max_tokens=5, temperature=0))
    engine.step()
    assert engine.last_step == StepStats(decodes=0, prefill_tokens=3, padding=0)
    engine.submit([4, 5, 6, 7], SamplingParams(max_tokens=2, temperature=0))
    engine.step()
    assert engine.last_step == StepStats(decodes=1, prefill_tokens=4, padding=0)
    static = Engine(MODEL, EngineConfig(kv_cache_blocks=64, block_size=4, static_batching=True))
    static.submit([1, 2], SamplingParams(max_tokens=1, temperature=0))
    static.submit([3, 4], SamplingParams(max_tokens=3, temperature=0))
    static.step()  # both prefilled; the first is done and pads the batch from now on
    static.step()
    assert static.last_step == StepStats(decodes=1, prefill_tokens=0, padding=1)


@st.composite
def shared_prefix_workloads(
    draw: st.DrawFn,
) -> tuple[EngineConfig, list[tuple[list[int], int, int]]]:
    """Requests whose prompts start with one of two common prefixes (system prompts, few-shot
    examples), arriving over time, in caches from tight (preemptions) to ample."""
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    prefixes = [[rng.randrange(64) for _ in range(rng.randint(0, 16))] for _ in range(2)]
    requests = []
    for _ in range(draw(st.integers(2, 7))):
        prompt = rng.choice(prefixes) + [rng.randrange(64) for _ in range(rng.randint(1, 6))]
        requests.append((prompt, rng.randint(1, 10), rng.choice([0, 1, 2, 4, 8])))
    block_size = draw(st.sampled_from([1, 2, 3, 4]))
    need = max(-(-(len(p) + m) // block_size) for p, m, _ in requests)
    config = EngineConfig(
        kv_cache_blocks=draw(st.integers(need, 3 * need)),
        block_size=block_size,
        max_num_seqs=draw(st.integers(1, 6)),
        max_batched_tokens=draw(st.sampled_from([2, 5, 64])),
        max_prefill_tokens=draw(st.sampled_from([None, 1, 3, 32])),
        # From admission that never preempts to one that lets preemption happen often.
        kv_overcommit=draw(st.sampled_from([1.0, 1.25, 4.0])),
        max_preemptions=draw(st.integers(1, 3)),
        watermark_blocks=draw(st.integers(0, 2)),
    )
    return config, requests


SHARED: list[int] = []


@settings(
    max_examples=40,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(shared_prefix_workloads())
def test_prefix_sharing_keeps_every_output_equal_to_one_request_at_a_time(
    workload: tuple[EngineConfig, list[tuple[list[int], int, int]]],
) -> None:
    config, requests = workload
    engine = Engine(MODEL, config)
    got = run_engine(engine, requests)
    for i, (prompt, max_tokens, _) in enumerate(requests):
        assert got[i] == reference(MODEL, prompt, max_tokens), f"request {i} of {config}"
    assert engine.cache.allocator.free == config.kv_cache_blocks  # every share released
    assert all(r == 0 for r in engine.cache.allocator.refs)
    SHARED.append(engine.prefix_hit_tokens)  # seen by hand: 17 of the 40 examples share


def test_a_later_request_shares_the_computed_blocks_of_its_prefix() -> None:
    rng = random.Random(3)
    system = [rng.randrange(64) for _ in range(12)]
    first, second = system + [1, 2, 3], system + [9, 8]
    config = EngineConfig(kv_cache_blocks=32, block_size=4, max_num_seqs=4)
    engine = Engine(MODEL, config)
    got = run_engine(engine, [(first, 8, 0), (second, 8, 3)])
    assert got[0] == reference(MODEL, first, 8) and got[1] == reference(MODEL, second, 8)
    assert engine.prefix_hit_tokens == 12  # three full blocks of the 12-token prefix
    off = Engine(
        MODEL, EngineConfig(kv_cache_blocks=32, block_size=4, max_num_seqs=4, prefix_sharing=False)
    )
    assert run_engine(off, [(first, 8, 0), (second, 8, 3)]) == got
    assert off.prefix_hit_tokens == 0
    # The same prompt again, a whole number of blocks long: all but its last block is shared,
    # since the last prompt token's logits must be computed to give the first new token.
    again = Engine(MODEL, config)
    same = system + [5, 6, 7, 8]
    out = run_engine(again, [(same, 6, 0), (same, 6, 3)])
    assert out[0] == out[1] == reference(MODEL, same, 6)
    assert again.prefix_hit_tokens == 12
