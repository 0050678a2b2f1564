"""Choosing the next token, and turning byte tokens back into text as they stream.

`sample` does greedy (temperature 0), temperature, top-k and top-p (nucleus; Holtzman et al.
2020) with a per-request `torch.Generator`, so a seeded request draws the same tokens whatever
else is batched with it (as long as the logits are the same). `TextStream` turns tokens into
text through their raw bytes (`hpcml.models.tokenizer`: UTF-8 bytes for the zoo `gpt`, a
byte-level BPE for imported GPT-2s) and holds back the bytes that may still turn out to be a
stop sequence or half of a multi-byte character.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field

import torch

from hpcml.models.tokenizer import ByteTokenizer, Tokenizer

__all__ = [
    "ByteTokenizer",
    "Logprob",
    "SamplingParams",
    "TextStream",
    "Tokenizer",
    "prompt_logprobs",
    "sample",
    "token_logprob",
]

Logprob = tuple[int, float, list[tuple[int, float]]]
"""(token, its log-probability, [(token, log-probability) of the k most likely, best first])."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    """0 picks the most likely token (greedy)."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 keeps all."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches top_p; 1 keeps all."""
    seed: int | None = None
    stop: tuple[bytes, ...] = field(default_factory=tuple)
    """Generation ends when the output ends with one of these; it is not part of the text."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token the output already holds (OpenAI's)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time the output already holds it."""
    logprobs: int | None = None
    """Report each generated token's log-probability and the `logprobs` most likely ones."""
    prompt_logprobs: int | None = None
    """Report the same for every prompt token after the first (prefix sharing is off then)."""

    def generator(self) -> torch.Generator | None:
        if self.temperature == 0:
            return None
        g = torch.Generator()
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed)
        return g


def penalize(logits: torch.Tensor, params: SamplingParams, output: list[int]) -> torch.Tensor:
    """`logits` less the presence and frequency penalties of the tokens in `output`."""
    if not output or (params.presence_penalty == 0 and params.frequency_penalty == 0):
        return logits
    counts = torch.bincount(torch.tensor(output), minlength=logits.numel())[: logits.numel()]
    counts = counts.to(logits.dtype)
    return logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    output: list[int] | None = None,
) -> int:
    """The next token id from one position's logits (vocab,), after the penalties for the
    tokens generated so far (`output`)."""
    logits = penalize(logits, params, output or [])
    if params.temperature == 0:
        return int(torch.argmax(logits))
    # float64: the vocabulary is small, and float32 rounding would move probabilities by more
    # than the model's own batch-to-batch differences (see the seeded-sampling test).
    scores = logits.double() / params.temperature
    if 0 < params.top_k < scores.numel():
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        # Drop a token when the tokens more likely than it already reach top_p; the most
        # likely token is always kept.
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        scores = scores.scatter(0, order[drop], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def _log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """Over the last dimension, in float32 at least (a bf16 model's logits are widened)."""
    wide = logits.float() if logits.dtype.itemsize < 4 else logits
    return torch.log_softmax(wide, dim=-1)


def _top(logprobs: torch.Tensor, k: int) -> list[tuple[int, float]]:
    if k <= 0:
        return []
    values, ids = torch.topk(logprobs, min(k, logprobs.numel()))
    return list(zip(ids.tolist(), values.tolist(), strict=True))


def token_logprob(logits: torch.Tensor, token: int, k: int) -> Logprob:
    """`token`'s log-probability under the model's distribution at one position (its raw
    logits: before temperature, top-k/top-p and penalties, as vLLM reports them) and the k most
    likely tokens there."""
    logprobs = _log_softmax(logits)
    return token, float(logprobs[token]), _top(logprobs, k)


def prompt_logprobs(
    chunk: torch.Tensor, tokens: list[int], first: int, prompt_len: int, have: int, k: int
) -> list[Logprob]:
    """Logprobs of the prompt tokens a chunk of logits predicts that are not reported yet:
    `chunk` holds the logits at positions first, first + 1, ... (the one at position p predicts
    token p + 1); tokens 1..`have` are reported already (a recompute after preemption repeats
    positions)."""
    start, stop = max(first, have), min(first + len(chunk), prompt_len - 1)
    if stop <= start:
        return []
    logprobs = _log_softmax(chunk[start - first : stop - first])
    targets = tokens[start + 1 : stop + 1]
    chosen = logprobs[torch.arange(len(targets)), torch.tensor(targets)].tolist()
    return [(t, lp, _top(row, k)) for t, lp, row in zip(targets, chosen, logprobs, strict=True)]


class TextStream:
    """Text deltas of a growing token stream: never emits bytes that could still start a stop
    sequence, nor half a UTF-8 character (invalid bytes become U+FFFD, as in `decode`). The
    tokenizer's end token adds no text."""

    def __init__(self, stop: tuple[bytes, ...] = (), tokenizer: Tokenizer | None = None) -> None:
        self.stop = stop
        self.tokenizer: Tokenizer = tokenizer or ByteTokenizer()
        # The last max-stop-length - 1 bytes stay back (they may begin a stop sequence the next
        # tokens complete), and so does everything from a completed stop sequence on: a token
        # may carry bytes past the end of one.
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.pending = b""
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        if token == self.tokenizer.end_token:
            return ""
        self.pending += self.tokenizer.token_bytes(token)
        cut = len(self.pending) - self.hold
        for s in self.stop:
            at = self.pending.find(s)
            cut = min(cut, at) if at >= 0 else cut
        if cut <= 0:
            return ""
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return self.decoder.decode(out)

    def finish(self, stopped_by: bytes | None) -> str:
        """The rest of the text; `stopped_by` (the stop sequence that ended it) is cut off with
        whatever followed it in its last token. Its first occurrence in `pending` is the one:
        the engine stops at the first token that completes any stop sequence, and `push` never
        emits the bytes of a completed one."""
        rest = self.pending
        if stopped_by:
            at = rest.find(stopped_by)
            rest = rest[:at] if at >= 0 else rest
        self.pending = b""
        return self.decoder.decode(rest, final=True)
