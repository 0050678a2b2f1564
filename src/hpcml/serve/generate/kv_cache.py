"""A paged KV cache: fixed-size blocks, a free list, and the per-step attention over it.

Keys and values of every layer live in one preallocated tensor each, `(layers, blocks *
block_size, heads, head_dim)`: memory is bounded by `kv_cache_blocks` from the start. A
sequence owns a block table (a list of block ids); token position p of a sequence lives in slot
`table[p // block_size] * block_size + p % block_size`. A table takes free blocks placed so that
it stays one contiguous run while it can (`BlockAllocator`) and gives them back when its
sequence finishes or is preempted. Full blocks of computed tokens are indexed by
their content and their parent block (so by the whole prefix they end): a new sequence whose
prompt starts with the same full blocks shares them (reference counts) instead of computing
and storing them again (prefix sharing); shared blocks are never written, since a sequence only
writes positions past what it has computed.

`StepAttention` is what the model's attention calls for one engine step (`GPT.forward(...,
cache=)`): the step's new tokens of all sequences come packed in one row (the linear layers see
no padding); their keys and values are written into their slots. A sequence whose blocks form
one contiguous run is then attended in place: its keys and values are a view of the cache, one
`scaled_dot_product_attention` call of its own, nothing copied. The allocator keeps tables in
one run while it can (a table grows into the next block; a new run starts mid-way into the
largest free run; a table that cannot grow so moves, copied once, to a free run that holds
it), so in place is the usual case; a split table (prefix sharing, a full cache) and small
contexts, whose copy costs less than a call of their own, are *gathered*
from their blocks (whole blocks at a time) into a contiguous, padded `(sequences, heads,
context, head_dim)` tensor per group of sequences of similar context length (`buckets`) and
attended under a mask. Before the in-place path, the gather copied every context on every
layer at every step (38% of a bf16 GPT-2-small decode step in one profile under load). A
fused paged-attention kernel (vLLM's) reads split tables in place too, but none ships with CPU
PyTorch; this keeps the engine pure torch and easy to check. Hand-written because no
maintained CPU library offers a paged cache for an arbitrary torch model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F


class BlockAllocator:
    """Block ids 0..num_blocks-1 with reference counts: a block shared by the prompts of
    several sequences (prefix sharing) is free again when the last of them releases it.

    Blocks are placed so that a sequence's table stays one contiguous run as long as it can
    (`StepAttention` then attends over the run in place, with no copy): a table grows into the
    block after its last one when that is free, and a new run starts in the middle of the
    largest free run, which leaves the sequence before it room to grow (at the start of the
    cache, or of a run nothing precedes, it starts at once); a table that cannot continue its
    run is offered a whole new one (`moved`). Anything can still take any free block:
    placement decides only how often a table is split."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._is_free = bytearray(b"\x01") * num_blocks
        self._free = num_blocks
        self.refs = [0] * num_blocks
        self.on_free: list[int] = []
        """Blocks freed since the owner last looked (the prefix index drops them)."""

    @property
    def free(self) -> int:
        return self._free

    @property
    def used(self) -> int:
        return self.num_blocks - self._free

    def _take(self, block: int) -> None:
        self._is_free[block] = 0
        self._free -= 1
        self.refs[block] = 1

    def _largest_run(self) -> tuple[int, int]:
        """(first block, length) of the largest run of free blocks (some block is free)."""
        best = max(_FREE_RUN.finditer(self._is_free), key=lambda m: m.end() - m.start())
        return best.start(), best.end() - best.start()

    def _run_start(self, blocks: int) -> int:
        """Where a new run of `blocks` starts: the middle of the largest free run, leaving
        its first half to the table that ends before it (the start when nothing does)."""
        start, length = self._largest_run()
        return start + max(0, (length - blocks) // 2) if start else 0

    def moved(self, table: list[int], blocks: int) -> list[int] | None:
        """For a table that cannot grow as one run (it is split, or the block after its last
        is taken) and whose blocks are its own (none shared): a new run for its blocks and
        `blocks` more, taken where `extend` would start one, if a free run holds them all;
        else None. Its old blocks stay taken: the caller copies them, then releases them."""
        nxt = table[-1] + 1
        if nxt < self.num_blocks and self._is_free[nxt] and one_run(table, len(table)):
            return None
        if any(self.refs[b] != 1 for b in table):
            return None
        total = len(table) + blocks
        if self._largest_run()[1] < total:
            return None
        run: list[int] = []
        self.extend(run, total)
        return run

    def extend(self, table: list[int], blocks: int) -> None:
        """Append `blocks` free blocks to `table` (the caller checked that enough are free),
        continuing its run where the next block is free."""
        assert blocks <= self._free, "extend past the free blocks"
        nxt = table[-1] + 1 if table else self.num_blocks
        for left in range(blocks, 0, -1):
            if nxt >= self.num_blocks or not self._is_free[nxt]:
                nxt = self._run_start(left)
            self._take(nxt)
            table.append(nxt)
            nxt += 1

    def share(self, block: int) -> None:
        assert self.refs[block] > 0, "only a block in use can be shared"
        self.refs[block] += 1

    def release(self, blocks: list[int]) -> None:
        for block in blocks:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self._is_free[block] = 1
                self._free += 1
                self.on_free.append(block)
        blocks.clear()


_FREE_RUN = re.compile(b"\x01+")


class PagedKVCache:
    def __init__(
        self,
        n_layer: int,
        n_head: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        shape = (n_layer, num_blocks * block_size, n_head, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

        self.prefix: dict[tuple[int, tuple[int, ...]], int] = {}
        """(parent block or -1, the block's tokens) -> block, for full computed blocks."""
        self._key_of: dict[int, tuple[int, tuple[int, ...]]] = {}

    def _forget_freed(self) -> None:
        for block in self.allocator.on_free:
            key = self._key_of.pop(block, None)
            if key is not None and self.prefix.get(key) == block:
                del self.prefix[key]
        self.allocator.on_free.clear()

    def share_prefix(self, table: list[int], tokens: list[int]) -> int:
        """Fill an empty `table` with indexed blocks matching the start of `tokens` (always
        leaving the last token to compute, whose logits the next step needs); tokens covered."""
        assert not table
        self._forget_freed()
        bs, parent = self.block_size, -1
        for i in range((len(tokens) - 1) // bs):
            block = self.prefix.get((parent, tuple(tokens[i * bs : (i + 1) * bs])))
            if block is None:
                break
            self.allocator.share(block)
            table.append(block)
            parent = block
        return len(table) * bs

    def register(self, table: list[int], tokens: list[int], start: int, stop: int) -> None:
        """Index the blocks that became full while positions start..stop-1 were computed."""
        self._forget_freed()
        bs = self.block_size
        for i in range(start // bs, stop // bs):
            parent = table[i - 1] if i else -1
            key = (parent, tuple(tokens[i * bs : (i + 1) * bs]))
            if key not in self.prefix and table[i] not in self._key_of:
                self.prefix[key] = table[i]
                self._key_of[table[i]] = key

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def grow(self, table: list[int], tokens: int) -> bool:
        """Extend `table` to hold `tokens` positions; False (table unchanged) if blocks run out.
        A table that cannot grow in place moves to a new run when one holds it (its keys and
        values copied once, rather than gathered at every later step); else it splits."""
        need = self.blocks_for(tokens) - len(table)
        if need > self.allocator.free:
            return False
        if need <= 0:
            return True
        run = self.allocator.moved(table, need) if table else None
        if run is None:
            self.allocator.extend(table, need)
            return True
        self._move(table, run)
        return True

    def _move(self, table: list[int], run: list[int]) -> None:
        """Copy `table`'s blocks (every layer) to the start of `run`, release them, and make
        `run` the table; its prefix-index entries follow it (keyed by their new parents)."""
        old, new = list(table), run[: len(table)]
        per_block = (self.k.shape[0], -1, self.block_size, *self.k.shape[2:])
        src = torch.tensor(old, device=self.k.device)
        dst = torch.tensor(new, device=self.k.device)
        for cache in (self.k, self.v):
            blocks = cache.view(per_block)
            blocks.index_copy_(1, dst, blocks.index_select(1, src))
        self._forget_freed()
        for i, (o, n) in enumerate(zip(old, new, strict=True)):
            key = self._key_of.pop(o, None)
            if key is not None and self.prefix.get(key) == o:
                del self.prefix[key]
                moved_key = (new[i - 1] if i else -1, key[1])
                self.prefix[moved_key] = n
                self._key_of[n] = moved_key
        self.allocator.release(table)
        table.extend(run)

    def slots(self, table: list[int], start: int, stop: int) -> torch.Tensor:
        """Flat slot indices of positions start..stop-1 of the sequence owning `table`."""
        pos = torch.arange(start, stop)
        blocks = torch.tensor(table, dtype=torch.long)[pos // self.block_size]
        return blocks * self.block_size + pos % self.block_size


@dataclass
class StepItem:
    """One sequence's part of a step: `n` new tokens at positions start..start+n-1."""

    table: list[int]
    start: int
    n: int


class _Group:
    """Sequences of a step attended together: queries padded to the group's longest chunk,
    contexts to its longest context in whole blocks."""

    def __init__(self, cache: PagedKVCache, items: list[tuple[int, StepItem]]) -> None:
        device = cache.k.device
        bs = cache.block_size
        b = len(items)
        t = max(it.n for _, it in items)
        nb = max(cache.blocks_for(it.start + it.n) for _, it in items)
        self.shape = (b, t, nb * bs)
        rows: list[int] = []  # the group's padded query rows that hold real tokens
        packed: list[int] = []  # where those tokens sit in the step's packed row
        query_pos = [[0] * t for _ in range(b)]
        tables = [[0] * nb for _ in range(b)]
        for i, (offset, it) in enumerate(items):
            rows += range(i * t, i * t + it.n)
            packed += range(offset, offset + it.n)
            # Padding queries (beyond it.n) keep position 0: they see key 0 only, so no row of
            # the mask is empty (an empty row would give NaN); their outputs are dropped.
            query_pos[i][: it.n] = range(it.start, it.start + it.n)
            used = cache.blocks_for(it.start + it.n)
            tables[i][:used] = it.table[:used]
        key_pos = torch.arange(nb * bs)
        qpos = torch.tensor(query_pos, dtype=torch.long)
        self.mask = (key_pos[None, None, :] <= qpos[:, :, None])[:, None].to(device)
        self.blocks = torch.tensor(tables, dtype=torch.long, device=device).view(-1)
        self.rows = torch.tensor(rows, dtype=torch.long, device=device)
        self.packed = torch.tensor(packed, dtype=torch.long, device=device)


GROUP_COST_POSITIONS = 256
"""What one more attention group costs, in key positions: a group is two block gathers, a mask
and one `scaled_dot_product_attention` call per layer, a fixed dispatch cost taken to equal
gathering and attending a few hundred key positions of a small model (an estimate, not a
tuned value; `benchmarks/llm_attention.py` times the result). A split pays when it saves more
padded positions than this."""


def buckets(items: list[tuple[int, StepItem]], block_size: int) -> list[list[tuple[int, StepItem]]]:
    """Split a step's sequences into groups attended together, so that what the step attends
    (each group padded to its longest context and chunk) follows the sum of the contexts, not
    sequences x the longest: sorted by context, the split that minimises the padded key
    positions plus `GROUP_COST_POSITIONS` per group (dynamic programming over the sorted
    order, n^2 for n <= max_num_seqs)."""
    if not items:
        return []
    order = sorted(items, key=lambda oi: (oi[1].start + oi[1].n, oi[1].n))
    ctx = [-(-(it.start + it.n) // block_size) * block_size for _, it in order]
    rows = [it.n for _, it in order]
    padding = len(order) * max(rows) * ctx[-1] - sum(r * c for r, c in zip(rows, ctx, strict=True))
    if padding <= GROUP_COST_POSITIONS:
        return [items]  # one group pads less than a second group would cost (the usual step)
    best = [0.0] + [float("inf")] * len(order)
    cut = [0] * (len(order) + 1)
    for j in range(1, len(order) + 1):
        widest = 0
        for i in range(j - 1, -1, -1):  # a group of order[i:j]: padded to ctx[j-1]
            widest = max(widest, rows[i])
            cost = best[i] + GROUP_COST_POSITIONS + (j - i) * widest * ctx[j - 1]
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups = []
    j = len(order)
    while j:
        groups.append(order[cut[j] : j])
        j = cut[j]
    return groups[::-1] if len(groups) > 1 else [items] if items else []


IN_PLACE_MIN_BYTES = 128 * 1024
"""A sequence whose blocks form one run is attended in place (no copy) when its keys and values
of one layer hold at least this many bytes: below it, gathering it into a group with the
others costs less than the `scaled_dot_product_attention` call of its own. One layer of 16
decoding sequences (`benchmarks/llm_kv_gather.py`, 2026-11-27, load 11-13): in place was
slower at 35-101 KB per sequence (contexts 16 and 32 of a 4 x 256 float32 and a 12 x 768 bf16
gpt: gather / in place 0.65-0.93x) and faster from 133 KB (context 64: 1.08-1.18x)."""


class _InPlace:
    """One sequence attended over its contiguous run of slots: views of the cache, no copy."""

    def __init__(self, cache: PagedKVCache, offset: int, it: StepItem) -> None:
        device = cache.k.device
        first = it.table[0] * cache.block_size
        self.rows = slice(offset, offset + it.n)
        self.slots = slice(first, first + it.start + it.n)
        # A chunk after cached positions sees all of them and its own causally (SDPA's
        # is_causal aligns the corners top-left, right only for a chunk from position 0).
        self.causal = it.n > 1 and it.start == 0
        self.mask: torch.Tensor | None = None
        if it.n > 1 and it.start:
            key_pos = torch.arange(it.start + it.n)
            query_pos = torch.arange(it.start, it.start + it.n)
            self.mask = (key_pos[None, :] <= query_pos[:, None]).to(device)


def one_run(table: list[int], blocks: int) -> bool:
    """The first `blocks` blocks of `table` are consecutive."""
    first = table[0]
    return all(table[i] == first + i for i in range(1, blocks))


class StepAttention:
    """The `KVCache` the model attends through during one engine step (see module docstring).

    A sequence whose used blocks are one contiguous run (the allocator keeps them so while it
    can) and whose context is large enough (`IN_PLACE_MIN_BYTES`) is attended in place: its
    keys and values are a view of the cache, no copy. The others are gathered: decoding
    sequences (one new token each) and sequences with a prompt chunk are grouped apart, so a
    step that carries a 32-token chunk does not pad every decode's query to 32 rows; within
    each kind, sequences are split by context length (`buckets`), so one long context does not
    pad every short one to its length. The context is gathered a block at a time (one
    `index_select` of whole blocks per layer and group, each a contiguous `block_size x heads
    x head_dim` run) rather than a slot at a time: on a 2-core CPU the per-slot gather was 58%
    of a 32-sequence decode step. A sequence's context is padded to its group's longest in
    whole blocks; the causal mask hides every padded key, since each query's position is below
    its own sequence's length. The step's small index tensors are built from Python lists, once
    per step, not per sequence and layer."""

    def __init__(self, cache: PagedKVCache, items: list[StepItem]) -> None:
        self.cache = cache
        bs = cache.block_size
        k = cache.k
        bytes_per_position = 2 * k.shape[2] * k.shape[3] * k.element_size()
        write: list[int] = []
        decodes: list[tuple[int, StepItem]] = []
        chunks: list[tuple[int, StepItem]] = []
        self.in_place: list[_InPlace] = []
        offset = 0
        for it in items:
            write += [it.table[p // bs] * bs + p % bs for p in range(it.start, it.start + it.n)]
            context = it.start + it.n
            if context * bytes_per_position >= IN_PLACE_MIN_BYTES and one_run(
                it.table, cache.blocks_for(context)
            ):
                self.in_place.append(_InPlace(cache, offset, it))
            else:
                (decodes if it.n == 1 else chunks).append((offset, it))
            offset += it.n
        self.tokens = offset
        self.groups = [_Group(cache, g) for kind in (decodes, chunks) for g in buckets(kind, bs)]
        self.write = torch.tensor(write, dtype=torch.long, device=cache.k.device)
        # One group of decodes in packed order: the packed row is already the padded layout.
        self.in_order = len(self.groups) == 1 and len(decodes) == len(items)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q, k, v: (1, heads, N, head_dim), the step's N new tokens packed in one row.
        heads, head_dim = q.shape[1], q.shape[3]
        k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]
        k_cache.index_copy_(0, self.write, k[0].transpose(0, 1))
        v_cache.index_copy_(0, self.write, v[0].transpose(0, 1))
        per_block = (-1, self.cache.block_size, heads, head_dim)
        packed_q = q[0].transpose(0, 1)  # (N, heads, head_dim)
        out = packed_q if self.in_order else q.new_empty(self.tokens, heads, head_dim)
        for s in self.in_place:
            y = F.scaled_dot_product_attention(
                packed_q[s.rows].transpose(0, 1).unsqueeze(0),  # (1, heads, n, head_dim)
                k_cache[s.slots].transpose(0, 1).unsqueeze(0),  # views of the cache
                v_cache[s.slots].transpose(0, 1).unsqueeze(0),
                attn_mask=s.mask,
                is_causal=s.causal,
            )
            out[s.rows] = y[0].transpose(0, 1)
        for g in self.groups:
            b, t, ctx = g.shape
            if t == 1:
                q_g = packed_q if self.in_order else packed_q[g.packed]
                q_g = q_g.unsqueeze(2)  # (b, heads, 1, head_dim)
            else:
                q_pad = q.new_zeros(b * t, heads, head_dim)
                q_pad[g.rows] = packed_q[g.packed]
                q_g = q_pad.view(b, t, heads, head_dim).transpose(1, 2)
            # (b, ctx, heads, head_dim): a copy of whole blocks
            keys = k_cache.view(per_block).index_select(0, g.blocks).view(b, ctx, heads, head_dim)
            vals = v_cache.view(per_block).index_select(0, g.blocks).view(b, ctx, heads, head_dim)
            y = F.scaled_dot_product_attention(
                q_g, keys.transpose(1, 2), vals.transpose(1, 2), attn_mask=g.mask
            )
            if self.in_order:
                out = y.squeeze(2)
            elif t == 1:
                out[g.packed] = y.squeeze(2)
            else:
                out[g.packed] = y.transpose(1, 2).reshape(b * t, heads, head_dim)[g.rows]
        return out.transpose(0, 1).unsqueeze(0)
