"""The generation engine: iteration-level (continuous) batching over a paged KV cache.

Every `step` is one forward pass of the model over the new tokens of every running sequence:
one token for a decoding sequence, a chunk of the prompt for a prefilling one (chunked prefill:
at most `max_batched_tokens` tokens per step, decodes first, so a long prompt does not stall
the others). Sequences are admitted from the waiting queue and retired at every step (Orca, Yu
et al. OSDI 2022; vLLM, Kwon et al. SOSP 2023).

Admission does not overcommit the cache into thrashing: a waiting sequence is admitted only
when blocks for its whole prompt (or whole recompute) are free, plus `watermark_blocks` while
others run, and while the running sequences at their longest (prompt plus max_tokens) need at
most `kv_overcommit` times the cache. When a running sequence needs a block and none is free,
the newest running sequence is preempted: its blocks are freed, and it goes back to the front
of the queue keeping the tokens it has generated; when readmitted it recomputes their keys and
values (prompt and output together, as one prefill) and carries on exactly where it was. After
`max_preemptions` a sequence is readmitted holding blocks for its longest length ("reserved":
it never grows, so it is never preempted again). A request that could not fit the whole cache
alone is refused when it is submitted, so preemption always ends: the oldest sequence can
always run, alone if need be, or waits a step for reserved ones, which only shrink the queue.

`static_batching=True` is the baseline the benchmark compares against: a batch is admitted only
when the previous one has finished, and finished sequences stay in the batch (each step
recomputes one cached position for them, as padding costs) until its longest one ends.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

import torch

from hpcml.models.gpt import GPT
from hpcml.serve.generate.kv_cache import PagedKVCache, StepAttention, StepItem
from hpcml.serve.generate.sampling import (
    ByteTokenizer,
    Logprob,
    SamplingParams,
    Tokenizer,
    prompt_logprobs,
    sample,
    token_logprob,
)


class RequestRefused(ValueError):
    """A request the engine can never serve (too long for the model or the cache)."""


@dataclass(frozen=True)
class EngineConfig:
    kv_cache_blocks: int = 256
    block_size: int = 16
    max_num_seqs: int = 32
    """Most sequences in one step."""
    max_batched_tokens: int = 256
    """Most new tokens in one step (prefill chunks plus one per decoding sequence)."""
    max_prefill_tokens: int | None = None
    """Most prompt (or recompute) tokens in a step that also decodes: every decoding sequence
    waits for the whole step, so this bounds how much arriving prompts lengthen its
    inter-token latency. A step without decodes prefills up to `max_batched_tokens`. None:
    no bound but `max_batched_tokens` (benchmarks/llm_step_profile.py: a bound of 32 or 8
    did not lower p99 inter-token latency at 16M parameters, and raised time to first token
    and the number of steps)."""
    static_batching: bool = False
    prefix_sharing: bool = True
    """Sequences whose prompts start with the same full blocks share those blocks' KV."""
    watermark_blocks: int = 1
    """Free blocks a sequence's admission must leave while others run (room for their next
    decode blocks, so an admission does not force a preemption at the very next step)."""
    max_preemptions: int = 2
    kv_overcommit: float = 1.25
    """Admit a sequence only while the running sequences' blocks at their longest (prompt plus
    max_tokens) fit in this many times the cache: 1.0 never preempts; more admits more
    sequences whose outputs may stop early, at the price of some preemptions (recompute)."""
    """After this many preemptions a sequence is readmitted holding blocks for its whole
    `prompt + max_tokens` (never preempted again): recompute work per sequence is bounded."""


@dataclass(frozen=True)
class StepStats:
    """What one step computed: decodes (one token after an output token), prompt or recompute
    tokens, and padding rows (static batching's finished sequences)."""

    decodes: int = 0
    prefill_tokens: int = 0
    padding: int = 0


@dataclass(eq=False)  # compared by identity: `running.remove(seq)` removes that sequence
class Sequence:
    id: int
    tokens: list[int]
    """Prompt, then generated tokens."""
    prompt_len: int
    params: SamplingParams
    generator: torch.Generator | None
    table: list[int] = field(default_factory=list)
    computed: int = 0
    """Tokens whose keys and values are in the cache."""
    finish_reason: str | None = None
    stopped_by: bytes | None = None
    preemptions: int = 0
    reserved: bool = False
    """Holds blocks for its longest possible length: it never grows, so is never preempted."""
    prompt_lps: list[Logprob] = field(default_factory=list)
    """Logprobs of prompt tokens 1.. (when its params ask for them)."""

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len :]


@dataclass(frozen=True)
class TokenEvent:
    """A token generated for sequence `seq_id` (None when it ended without one: aborted)."""

    seq_id: int
    token: int | None
    finish_reason: str | None = None
    """None while it goes on; "stop", "length" or "abort" on its last event."""
    stopped_by: bytes | None = None
    reason: str | None = None
    """Why an "abort" happened, one sentence for the client (None: not aborted here)."""
    logprob: Logprob | None = None
    """The token's logprob (when the request's params ask for it)."""
    prompt_logprobs: list[Logprob] | None = None
    """On a sequence's first token, its prompt's logprobs (when its params ask for them)."""


def _decodes(seq: Sequence, n: int) -> bool:
    """A chunk of `n` tokens is a decode: the one token after an output token (a client waits
    for the next one since the last)."""
    return n == 1 and seq.computed + 1 == len(seq.tokens) > seq.prompt_len


def check_request(
    prompt: list[int], params: SamplingParams, max_seq_len: int, capacity: int
) -> None:
    """Raise RequestRefused if a request can never be served by an engine whose model has a
    context of `max_seq_len` and whose KV cache holds `capacity` tokens."""
    if not prompt:
        raise RequestRefused("the prompt is empty; send at least one character.")
    total = len(prompt) + params.max_tokens
    if total > max_seq_len:
        raise RequestRefused(
            f"prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) is "
            f"{total}, more than the model's context of {max_seq_len}; shorten one."
        )
    if total > capacity:
        raise RequestRefused(
            f"prompt plus max_tokens ({total} tokens) exceeds the KV cache ({capacity} "
            "tokens); shorten the request or raise kv_cache_blocks."
        )


class Engine:
    def __init__(
        self, model: GPT, config: EngineConfig, tokenizer: Tokenizer | None = None
    ) -> None:
        """`tokenizer` gives the bytes stop sequences are matched on and the end token (bytes,
        no end token, when None); tokens without bytes in it (a model vocabulary padded beyond
        the tokenizer's) are never sampled."""
        cfg = model.cfg
        self.model = model.eval()
        self.config = config
        self.tokenizer: Tokenizer = tokenizer or ByteTokenizer()
        self.vocab_limit = min(int(cfg.vocab_size), self.tokenizer.vocab_size)
        self.max_seq_len = int(cfg.max_seq_len)
        dtype = next(model.parameters()).dtype
        device = next(model.parameters()).device
        self.cache = PagedKVCache(
            cfg.n_layer,
            cfg.n_head,
            cfg.head_dim,
            config.kv_cache_blocks,
            config.block_size,
            dtype,
            device,
        )
        self.device = device
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._ghosts: list[Sequence] = []  # static batching: finished, still padding the batch
        self._ids = itertools.count()
        self.preemptions = 0
        self.rows_computed = 0
        """Token positions run through the model so far, padding (static batching) included."""
        # Prefix sharing (see kv_cache): off under static batching, whose finished sequences
        # rewrite their last slot every step ("ghosts") and so could touch an indexed block.
        self.sharing = config.prefix_sharing and not config.static_batching
        self.prefix_hit_tokens = 0
        """Prompt tokens found in the prefix cache at admission (so not computed)."""
        self.prefix_query_tokens = 0
        """Tokens of sequences admitted (their whole prompt, or prompt and output on a
        readmission): what the prefix cache was asked for."""
        self.admitted: list[int] = []
        """Ids of sequences admitted for the first time since the owner last looked."""
        self.batch_size = 0
        """Sequences in the last step."""
        self.last_step = StepStats()
        """What the last step computed (benchmarks/llm_step_profile.py reads it)."""

    def submit(self, prompt: list[int], params: SamplingParams, seq_id: int | None = None) -> int:
        """Queue a request; its id. Raises RequestRefused if it can never be served."""
        self.check(prompt, params)
        seq_id = next(self._ids) if seq_id is None else seq_id
        seq = Sequence(seq_id, list(prompt), len(prompt), params, params.generator())
        self.waiting.append(seq)
        return seq.id

    def check(self, prompt: list[int], params: SamplingParams) -> None:
        """Raise RequestRefused if this request can never be served (reads only settings)."""
        capacity = self.cache.allocator.num_blocks * self.cache.block_size
        check_request(prompt, params, self.max_seq_len, capacity)

    def abort(self, seq_id: int) -> bool:
        """Drop a queued or running sequence (its client went away); whether it was found."""
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.id == seq_id:
                    queue.remove(seq)
                    self.cache.allocator.release(seq.table)
                    return True
        return False

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def blocks_used(self) -> int:
        return self.cache.allocator.used

    # Scheduling --------------------------------------------------------------------------
    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.cache.allocator.release(seq.table)
        seq.computed = 0
        seq.preemptions += 1
        seq.reserved = seq.preemptions >= self.config.max_preemptions
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def _prefill_room(self, plan: list[tuple[Sequence, int]], budget: int) -> int:
        """Prompt tokens the step may still take: `budget`, and, once it decodes, at most
        `max_prefill_tokens` in all."""
        cap = self.config.max_prefill_tokens
        decodes = sum(1 for s, n in plan if _decodes(s, n))
        if cap is None or not decodes:
            return budget
        return min(budget, cap - (sum(n for _, n in plan) - decodes))

    def _plan_running(self, budget: int) -> tuple[list[tuple[Sequence, int]], int]:
        """Chunks for running sequences, oldest first. Decodes (1 token) come before prefill
        chunks, which share `max_prefill_tokens` when the step decodes. A decode that needs a
        block when none is free preempts the newest running sequence that is not reserved
        (itself if it is the newest); when that would be itself while reserved sequences hold
        blocks, it waits a step instead (they never grow, and free their blocks when they
        end)."""
        order = sorted(self.running, key=lambda s: (len(s.tokens) - s.computed > 1, s.id))
        plan: list[tuple[Sequence, int]] = []
        for seq in order:
            if seq not in self.running:  # preempted while planning an older one
                continue
            left = len(seq.tokens) - seq.computed
            n = min(left, budget if left == 1 else self._prefill_room(plan, budget))
            if n <= 0:
                continue
            while not self.cache.grow(seq.table, seq.computed + n):
                victim = max((s for s in self.running if not s.reserved), key=lambda s: s.id)
                if victim is seq and any(s.reserved for s in self.running):
                    break  # stall one step
                budget += sum(k for s, k in plan if s is victim)
                plan = [(s, k) for s, k in plan if s is not victim]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                plan.append((seq, n))
                budget -= n
        budget = self.config.max_batched_tokens - sum(k for _, k in plan)
        return plan, budget

    def _admit(self, plan: list[tuple[Sequence, int]], budget: int) -> None:
        """Admit waiting sequences in order while their whole (re)prefill fits in the free
        blocks, plus `watermark_blocks` to spare while others run: blocks are taken for the
        whole prefill at once, so chunks of several prefills never compete for blocks, and
        admitting never preempts (the queue waits for blocks)."""
        if self.config.static_batching and (self.running or self._ghosts):
            return
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if self.sharing and not seq.table and seq.params.prompt_logprobs is None:
                seq.computed = self.cache.share_prefix(seq.table, seq.tokens)
            full = seq.prompt_len + seq.params.max_tokens if seq.reserved else len(seq.tokens)
            need = self.cache.blocks_for(full) - len(seq.table)
            spare = self.config.watermark_blocks if self.running else 0
            if need + spare > self.cache.allocator.free or not self._room_for(seq):
                if self.sharing:  # hold no shared blocks while waiting
                    self.cache.allocator.release(seq.table)
                    seq.computed = 0
                break
            n = min(len(seq.tokens) - seq.computed, self._prefill_room(plan, budget))
            if n <= 0:  # this step's prompt tokens are spent: admit it next step
                if self.sharing:
                    self.cache.allocator.release(seq.table)
                    seq.computed = 0
                break
            grown = self.cache.grow(seq.table, full)
            assert grown
            self.waiting.popleft()
            self.running.append(seq)
            plan.append((seq, n))
            budget -= n
            self.prefix_hit_tokens += seq.computed
            self.prefix_query_tokens += len(seq.tokens)
            if not seq.preemptions:
                self.admitted.append(seq.id)

    def _longest(self, seq: Sequence) -> int:
        return self.cache.blocks_for(seq.prompt_len + seq.params.max_tokens)

    def _room_for(self, seq: Sequence) -> bool:
        if not self.running:
            return True
        planned = sum(self._longest(s) for s in self.running) + self._longest(seq)
        return planned <= self.config.kv_overcommit * self.cache.allocator.num_blocks

    def step(self) -> list[TokenEvent]:
        """One forward pass over the planned chunks; the tokens it generated."""
        self._end_static_batch()
        plan, budget = self._plan_running(self.config.max_batched_tokens)
        self._admit(plan, budget)
        self.batch_size = len(plan)
        decodes = sum(1 for s, n in plan if _decodes(s, n))
        prefill = sum(n for _, n in plan) - decodes
        self.last_step = StepStats(decodes, prefill, len(self._ghosts) if plan else 0)
        if not plan:
            return []
        ghosts = [(g, 0) for g in self._ghosts]
        items = [StepItem(s.table, s.computed, n) for s, n in plan]
        # A ghost recomputes its last cached position: same token, same slot, same values.
        items += [StepItem(g.table, g.computed - 1, 1) for g, _ in ghosts]
        idx = [t for s, n in plan for t in s.tokens[s.computed : s.computed + n]]
        idx += [g.tokens[g.computed - 1] for g, _ in ghosts]
        pos = [p for it in items for p in range(it.start, it.start + it.n)]
        self.rows_computed += len(idx)
        # Logits only where they are read: a chunk's last position (the next token), or all
        # of its positions when its request asks for prompt logprobs; ghosts need none.
        rows: list[int] = []
        end = 0
        for s, n in plan:
            end += n
            rows += range(end - n, end) if s.params.prompt_logprobs is not None else [end - 1]
        with torch.inference_mode():
            logits = self.model(
                torch.tensor([idx], device=self.device),
                torch.tensor([pos], device=self.device),
                StepAttention(self.cache, items),
                rows=torch.tensor(rows, device=self.device),
            )[0]
        return self._advance(plan, logits)

    def _advance(self, plan: list[tuple[Sequence, int]], logits: torch.Tensor) -> list[TokenEvent]:
        """`logits`: the rows `step` asked for, a chunk's all (prompt logprobs) or its last."""
        events = []
        end = 0
        for seq, n in plan:
            p = seq.params
            k = n if p.prompt_logprobs is not None else 1
            end += k
            if self.sharing:
                self.cache.register(seq.table, seq.tokens, seq.computed, seq.computed + n)
            rows = logits[end - k : end, : self.vocab_limit]
            if p.prompt_logprobs is not None:
                seq.prompt_lps += prompt_logprobs(
                    rows,
                    seq.tokens,
                    seq.computed,
                    seq.prompt_len,
                    len(seq.prompt_lps),
                    p.prompt_logprobs,
                )
            seq.computed += n
            if seq.computed < len(seq.tokens):
                continue  # prefill (or recompute) not done yet
            token = sample(rows[-1], p, seq.generator, seq.output)
            seq.tokens.append(token)
            self._check_finished(seq)
            lp = token_logprob(rows[-1], token, p.logprobs) if p.logprobs is not None else None
            first = p.prompt_logprobs is not None and len(seq.output) == 1
            events.append(
                TokenEvent(
                    seq_id=seq.id,
                    token=token,
                    finish_reason=seq.finish_reason,
                    stopped_by=seq.stopped_by,
                    logprob=lp,
                    prompt_logprobs=seq.prompt_lps if first else None,
                )
            )
            if seq.finish_reason is not None:
                self._retire(seq)
        self._end_static_batch()
        return events

    def _end_static_batch(self) -> None:
        if not self.running and self._ghosts:
            for ghost in self._ghosts:
                self.cache.allocator.release(ghost.table)
            self._ghosts = []

    def _check_finished(self, seq: Sequence) -> None:
        token = seq.tokens[-1]
        if token == self.tokenizer.end_token:
            seq.finish_reason = "stop"
            return
        if seq.params.stop:
            stop = self._stop_in(seq.output, seq.params.stop)
            if stop is not None:
                seq.finish_reason, seq.stopped_by = "stop", stop
                return
        if len(seq.output) >= seq.params.max_tokens:
            seq.finish_reason = "length"

    def _stop_in(self, output: list[int], stops: tuple[bytes, ...]) -> bytes | None:
        """The stop sequence that starts first among those the newest token completes: one
        that ends inside it or at its end, and may start in earlier tokens (a stop sequence
        need not end on a token boundary). Older ones were found by earlier calls."""
        new = self.tokenizer.token_bytes(output[-1])
        need, before, i = max(len(s) for s in stops) - 1, b"", len(output) - 1
        while len(before) < need and i > 0:
            i -= 1
            before = self.tokenizer.token_bytes(output[i]) + before
        window = before[len(before) - need :] + new if need else new
        found = [(at, s) for s in stops if (at := window.find(s)) >= 0]
        return min(found, key=lambda f: f[0])[1] if found else None

    def _retire(self, seq: Sequence) -> None:
        self.running.remove(seq)
        if self.config.static_batching:
            self._ghosts.append(seq)
        else:
            self.cache.allocator.release(seq.table)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Every prompt's output tokens, all submitted at once and run to the end."""
        ids = [self.submit(p, params) for p in prompts]
        out: dict[int, list[int]] = {i: [] for i in ids}
        while self.has_work:
            for ev in self.step():
                if ev.token is not None:
                    out[ev.seq_id].append(ev.token)
        return [out[i] for i in ids]
