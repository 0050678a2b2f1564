"""The choices of one OpenAI request: each (prompt, sample) pair generated as its own sequence
in the engine, all at once, their pieces of text and logprobs merged in the order they come.

Logprobs are the model's own (raw logits, before temperature, top-k/top-p and penalties, as
vLLM reports them). A token's text is its bytes as UTF-8, bytes that are not a whole character
written as `\\xNN` escapes (a byte-level BPE token may hold half a character).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import Any

from hpcml.serve.generate.sampling import Logprob, SamplingParams, TextStream, Tokenizer
from hpcml.serve.generate.service import GenerationService

ABORTED = (
    "the server stopped generating this request (it is shutting down, or its generation process "
    "died and is being restarted); retry."
)
"""What an abort without a reason of its own tells the client."""


class Aborted(Exception):
    """The engine stopped generating; its message names why (the event's reason)."""


@dataclass
class Piece:
    """What one choice produced since its previous piece."""

    index: int
    text: str = ""
    logprobs: list[Logprob | None] = field(default_factory=list)
    """Logprobs of the tokens behind `text` (None for a prompt's first token)."""
    tokens: int = 0
    """Generated tokens behind it."""
    finish: str | None = None


@dataclass(frozen=True)
class Choice:
    """One sequence to generate: `echo` puts its prompt (text and logprobs) first;
    `keep_tokens` False generates one token and reports none (max_tokens 0)."""

    index: int
    prompt: list[int]
    params: SamplingParams
    echo: bool = False
    keep_tokens: bool = True


def token_text(tokenizer: Tokenizer, token: int) -> str:
    return tokenizer.token_bytes(token).decode("utf-8", errors="backslashreplace")


def prompt_text(tokenizer: Tokenizer, prompt: list[int]) -> str:
    return b"".join(tokenizer.token_bytes(t) for t in prompt).decode("utf-8", errors="replace")


async def run_choice(service: GenerationService, c: Choice) -> AsyncGenerator[Piece, None]:
    """Pieces of one choice: a piece per non-empty text delta, the last with the finish reason.
    Raises Aborted, with the engine's reason, when the engine stops."""
    stream = TextStream(c.params.stop, service.tokenizer)
    piece = Piece(c.index)
    if c.echo:
        piece.text = prompt_text(service.tokenizer, c.prompt)
    async with aclosing(service.generate(c.prompt, c.params)) as events:
        async for ev in events:
            if ev.prompt_logprobs is not None and c.echo:
                piece.logprobs += [None, *ev.prompt_logprobs]
            if ev.token is not None and c.keep_tokens:
                piece.tokens += 1
                piece.text += stream.push(ev.token)
                if ev.logprob is not None:
                    piece.logprobs.append(ev.logprob)
            if ev.finish_reason == "abort":
                raise Aborted(ev.reason or ABORTED)
            if ev.finish_reason is not None:
                piece.text += stream.finish(ev.stopped_by)
                piece.finish = ev.finish_reason if c.keep_tokens else "length"
                yield piece
                return
            if piece.text:
                yield piece
                piece = Piece(c.index)


async def merged(service: GenerationService, choices: list[Choice]) -> AsyncGenerator[Piece, None]:
    """The pieces of every choice as they come. Leaving early (a client gone) or one choice's
    Aborted cancels them all, which aborts their sequences in the engine."""
    if len(choices) == 1:
        async with aclosing(run_choice(service, choices[0])) as pieces:
            async for piece in pieces:
                yield piece
        return
    queue: asyncio.Queue[Piece | BaseException | None] = asyncio.Queue()

    async def pump(c: Choice) -> None:
        try:
            async with aclosing(run_choice(service, c)) as pieces:
                async for piece in pieces:
                    queue.put_nowait(piece)
            queue.put_nowait(None)
        except Aborted as exc:
            queue.put_nowait(exc)

    tasks = [asyncio.ensure_future(pump(c)) for c in choices]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(service: GenerationService, choices: list[Choice]) -> list[Piece]:
    """Every choice's whole piece, in index order."""
    out = {c.index: Piece(c.index) for c in choices}
    async with aclosing(merged(service, choices)) as pieces:
        async for p in pieces:
            whole = out[p.index]
            whole.text += p.text
            whole.logprobs += p.logprobs
            whole.tokens += p.tokens
            whole.finish = p.finish or whole.finish
    return [out[c.index] for c in choices]


def expand(
    prompts: list[list[int]], params: SamplingParams, n: int, echo: bool, keep: bool
) -> list[Choice]:
    """n choices per prompt, index prompt * n + sample; a seeded request's samples get seeds
    seed, seed + 1, ... (so they differ, and each is reproducible)."""
    out = []
    for i, prompt in enumerate(prompts):
        for j in range(n):
            p = params
            if params.seed is not None and j:
                p = replace(params, seed=(params.seed + j) % 2**64)
            out.append(Choice(i * n + j, prompt, p, echo, keep))
    return out


def usage(prompts: list[list[int]], completion_tokens: int) -> dict[str, int]:
    prompt = sum(len(p) for p in prompts)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt + completion_tokens,
    }


def completion_logprobs(
    tokenizer: Tokenizer, entries: list[Logprob | None], prompt: list[int], offset: int
) -> dict[str, Any]:
    """The legacy Completions API's logprobs object; a None entry is the prompt's first token
    (nothing predicts it). `offset`: where the first token's text starts in the choice's text."""
    tokens: list[str] = []
    token_lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for entry in entries:
        if entry is None:
            tokens.append(token_text(tokenizer, prompt[0]))
            token_lps.append(None)
            tops.append(None)
        else:
            token, lp, top = entry
            tokens.append(token_text(tokenizer, token))
            token_lps.append(lp)
            tops.append({token_text(tokenizer, t): v for t, v in top})
        offsets.append(offset)
        offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(tokenizer: Tokenizer, entries: list[Logprob | None]) -> dict[str, Any]:
    """The Chat Completions API's logprobs object."""

    def item(token: int, lp: float) -> dict[str, Any]:
        return {
            "token": token_text(tokenizer, token),
            "logprob": lp,
            "bytes": list(tokenizer.token_bytes(token)),
        }

    content = []
    for entry in entries:
        if entry is not None:
            token, lp, top = entry
            content.append({**item(token, lp), "top_logprobs": [item(t, v) for t, v in top]})
    return {"content": content}
