"""Attention over the KV cache in place: a sequence whose blocks form one run is attended over
a view of the cache, with no gathered copy of its context.

Two things must hold. The allocator must keep tables in one run while the cache has room (a
table grows into the block after its last one; a new run starts mid-way into the largest free
run; a table that cannot grow so moves to a new run, keys and values copied), or the in-place
path is never taken: counted here as `index_select` calls (the gather)
during decode steps. And the in-place path must attend exactly what the gather did: greedy
outputs equal one-request-at-a-time full recompute over the engine tests' own Hypothesis
workloads (preemption, chunked prefill, prefix sharing, whose split tables are still gathered
in the same steps), with every sequence in place wherever its table allows
(`IN_PLACE_MIN_BYTES = 0`). Float64 model and the reference's 1e-9 margin, as in
test_generate_engine.py, so no rounding difference can flip a token.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from generate_util import one_thread, reference
from hypothesis import HealthCheck, given, settings
from test_generate_engine import MODEL, run_engine, shared_prefix_workloads, workloads
from torch.overrides import TorchFunctionMode

from hpcml.serve.generate import kv_cache
from hpcml.serve.generate.engine import Engine, EngineConfig
from hpcml.serve.generate.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

Workload = tuple[EngineConfig, list[tuple[list[int], int, int]]]


class Calls(TorchFunctionMode):
    """Counts the gathers (`index_select`) and attention calls it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.gathers = self.attends = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        self.gathers += name == "index_select"
        self.attends += name == "scaled_dot_product_attention"
        return func(*args, **(kwargs or {}))


@pytest.fixture
def in_place_always(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_cache, "IN_PLACE_MIN_BYTES", 0)


@pytest.mark.usefixtures(in_place_always.__name__)
def test_decoding_sequences_keep_one_run_each_and_copy_no_context() -> None:
    """Six sequences admitted together, each growing past several block boundaries while the
    others grow too: with first-free allocation (main's free list) each prompt's blocks follow
    the one before, every table splits at its first growth and decode steps gather; placed as
    runs, no decode step gathers, and the outputs equal full recompute."""
    rng = random.Random(5)
    prompts = [[rng.randrange(64) for _ in range(rng.randint(3, 12))] for _ in range(6)]
    need = sum(-(-(len(p) + 14) // 2) for p in prompts)  # room for all: no preemption
    engine = Engine(MODEL, EngineConfig(kv_cache_blocks=2 * need, block_size=2, max_num_seqs=6))
    ids = [engine.submit(p, SamplingParams(max_tokens=14, temperature=0)) for p in prompts]
    out: dict[int, list[int]] = {i: [] for i in ids}
    decode_steps = 0
    while engine.has_work:
        decoding = not engine.waiting and all(
            s.computed + 1 == len(s.tokens) for s in engine.running
        )
        with Calls() as calls:
            events = engine.step()
        if decoding:
            decode_steps += 1
            tables = [s.table for s in engine.running]
            assert calls.gathers == 0, f"a decode step gathered (tables {tables})"
            assert calls.attends == MODEL.cfg.n_layer * len(
                events
            )  # one call per sequence and layer
        for ev in events:
            out[ev.seq_id].append(ev.token)  # type: ignore[arg-type]
    assert decode_steps >= 10
    for i, prompt in zip(ids, prompts, strict=True):
        assert out[i] == reference(MODEL, prompt, 14)


def check(workload: Workload) -> None:
    """Outputs equal full recompute with every one-run table attended in place (set here, not
    by a fixture: Hypothesis runs many examples per call of a function-scoped fixture)."""
    config, requests = workload
    engine = Engine(MODEL, config)
    seen = []

    class Counted(kv_cache._InPlace):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            seen.append(self)

    saved = kv_cache.IN_PLACE_MIN_BYTES, kv_cache._InPlace
    kv_cache.IN_PLACE_MIN_BYTES, kv_cache._InPlace = 0, Counted  # type: ignore[misc]
    try:
        got = run_engine(engine, requests)
    finally:
        kv_cache.IN_PLACE_MIN_BYTES, kv_cache._InPlace = saved  # type: ignore[misc]
    assert seen, "no sequence was attended in place"
    for i, (prompt, max_tokens, _) in enumerate(requests):
        assert got[i] == reference(MODEL, prompt, max_tokens), f"request {i} of {config}"
    assert engine.cache.allocator.free == config.kv_cache_blocks
    assert all(r == 0 for r in engine.cache.allocator.refs)


SETTINGS = settings(
    max_examples=20, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@SETTINGS
@given(workloads())
def test_in_place_attention_keeps_greedy_outputs_equal_to_full_recompute(
    workload: Workload,
) -> None:
    check(workload)


@SETTINGS
@given(shared_prefix_workloads())
def test_in_place_attention_beside_shared_prefixes_keeps_outputs_equal(workload: Workload) -> None:
    check(workload)


def test_a_new_run_starts_mid_way_into_the_largest_free_run() -> None:
    """The placement that keeps tables whole: growth continues a run, a new table starts in the
    middle of the largest free run (its first half left to the table before it), at block 0
    when nothing precedes, and a table that cannot continue moves on to a new run."""
    alloc = kv_cache.BlockAllocator(20)
    first: list[int] = []
    alloc.extend(first, 2)
    assert first == [0, 1]
    second: list[int] = []
    alloc.extend(second, 2)  # free run 2..19 (18 blocks): middle of it for 2 blocks
    assert second == [10, 11]
    alloc.extend(first, 3)
    assert first == [0, 1, 2, 3, 4]
    third: list[int] = []
    alloc.extend(third, 1)  # free runs 5..9 and 12..19: the larger, mid-way
    assert third == [15]
    alloc.release(second)
    assert alloc.free == 20 - 6 and alloc.refs[10] == 0
    wedged = [8]  # a table whose next block is taken continues in a new run: free runs
    alloc._take(8)  # are 5..7, 10..14 and 16..19, so mid-way into 10..14
    alloc._take(9)
    alloc.extend(wedged, 2)
    assert wedged == [8, 11, 12] and alloc.free == 20 - 10
    assert alloc.refs[10:13] == [0, 1, 1]


def test_a_table_that_cannot_grow_in_place_moves_with_its_keys_and_values() -> None:
    """A table whose next block another took moves to a new run when one holds it: its keys
    and values copied on every layer, its old blocks freed, its prefix-index entries keyed by
    the new blocks (a later prompt still shares them). Without the move it would split, and be
    gathered at every later step."""
    cache = kv_cache.PagedKVCache(2, 1, 2, 12, 2)  # 2 layers, 1 head of 2, 12 blocks of 2
    a: list[int] = []
    assert cache.grow(a, 4) and a == [0, 1]
    b: list[int] = []
    assert cache.grow(b, 2) and b == [6]  # mid-way into the free run 2..11
    cache.allocator._take(2)  # another table took the block after a's last
    tokens = [5, 6, 7, 8]
    cache.register(a, tokens, 0, 4)
    gen = torch.Generator().manual_seed(0)
    slots = cache.slots(a, 0, 4)
    cache.k[:, slots] = torch.randn(2, 4, 1, 2, generator=gen)
    cache.v[:, slots] = torch.randn(2, 4, 1, 2, generator=gen)
    keys, values = cache.k[:, slots].clone(), cache.v[:, slots].clone()
    assert cache.grow(a, 5)
    assert a == [8, 9, 10]  # free runs 3..5 and 7..11: mid-way into the larger
    moved = cache.slots(a, 0, 4)
    assert torch.equal(cache.k[:, moved], keys) and torch.equal(cache.v[:, moved], values)
    assert cache.allocator.refs[:2] == [0, 0] and cache.allocator.free == 12 - 5
    c: list[int] = []
    assert cache.share_prefix(c, [*tokens, 9]) == 4 and c == [8, 9]
