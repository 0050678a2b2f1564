"""`POST /v1/completions` and `GET /v1/models`, OpenAI-compatible, over the generation services
of a server.

The request and answer follow OpenAI's legacy Completions API (what the official `openai`
client's `client.completions.create` sends and reads): a prompt is a string, a list of token
ids, or a list of several of either (each gets `n` choices, index prompt * n + sample);
`max_tokens` null generates until the model's context (or the KV cache) is full, 0 with `echo`
scores the prompt only (a prompt shorter than the context: one token past it is computed and
not returned); `logprobs` k (at most 20) reports each token's log-probability and the
k most likely tokens, for the prompt too with `echo` (what lm-eval-harness's loglikelihood
reads); presence and frequency penalties as OpenAI defines them. `stream: true` answers with
server-sent events, one `text_completion` chunk per text delta, a last chunk with `usage` when
`stream_options.include_usage` is true, and `data: [DONE]`. `top_k` is an extension (as in
vLLM). `best_of` other than n, `suffix` and `logit_bias` are refused with 400 rather than
ignored, in OpenAI's error shape `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import replace
from typing import Annotated, Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hpcml.serve.generate.choices import (
    ABORTED,
    Aborted,
    Choice,
    Piece,
    collect,
    completion_logprobs,
    expand,
    merged,
    usage,
)
from hpcml.serve.generate.disconnect import Disconnected, unless_disconnected
from hpcml.serve.generate.engine import RequestRefused
from hpcml.serve.generate.sampling import SamplingParams, TextStream, Tokenizer
from hpcml.serve.generate.service import GenerationService, QueueFull
from hpcml.serve.tokens import forbidden_model

Stop = Annotated[str, Field(min_length=1)]
M = TypeVar("M", bound=BaseModel)


MAX_CHOICES = 128
"""Most choices (prompts x n) in one request."""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=0)
    seed: int | None = Field(None, ge=0, le=2**64 - 1)  # torch.Generator.manual_seed's range
    stop: Stop | list[Stop] | None = Field(None)
    stream: bool = False
    user: str | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    stream_options: StreamOptions | None = None
    # OpenAI parameters accepted only at their neutral values.
    best_of: int | None = None
    logit_bias: dict[str, float] | None = None
    suffix: str | None = None


NEUTRAL: dict[str, tuple[Any, ...]] = {
    "logit_bias": (None, {}),
    "suffix": (None, ""),
}


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


def error(status: int, message: str, param: str | None = None) -> Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    # Every 503 here (shutting down, engine restarting) is one a retry, elsewhere, may cure.
    headers = {"Retry-After": "1"} if status in (429, 503) else None
    return JSONResponse(body, status_code=status, headers=headers)


def load_body(body: bytes) -> dict[str, Any]:
    """The JSON object of a request body; BadRequest for anything else, and for text that
    cannot be UTF-8 (a lone surrogate escape such as \\ud800 is valid JSON but no character:
    it would fail later, in the tokenizer or in the error message that quotes it)."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadRequest("the request body is not valid JSON; send a JSON object.") from None
    if not isinstance(data, dict):
        raise BadRequest("the request body must be a JSON object.")
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(
            "the request holds text that is not valid Unicode (a lone UTF-16 surrogate escape "
            "such as \\ud800); send UTF-8 text."
        ) from None
    return data


def validate(model: type[M], data: dict[str, Any]) -> M:
    """`data` as `model`; BadRequest naming the first offending parameter."""
    try:
        return model.model_validate(data)
    except ValidationError as err:
        e = err.errors()[0]
        where = ".".join(str(p) for p in e["loc"]) or "body"
        if e["type"] == "extra_forbidden":
            raise BadRequest(f"parameter '{where}' is not known; remove it.", where) from None
        raise BadRequest(f"parameter '{where}': {e['msg']}.", where.split(".")[0]) from None


def parse_request(body: bytes) -> CompletionRequest:
    req = validate(CompletionRequest, load_body(body))
    for name, allowed in NEUTRAL.items():
        if getattr(req, name) not in allowed:
            raise BadRequest(
                f"parameter '{name}' = {getattr(req, name)!r} is not supported by this server; "
                "leave it out.",
                name,
            )
    if req.best_of not in (None, req.n):
        raise BadRequest(
            f"parameter 'best_of' = {req.best_of} is not supported by this server (only best_of "
            "= n); leave it out.",
            "best_of",
        )
    if isinstance(req.prompt, list) and not req.prompt:
        raise BadRequest("'prompt' is an empty list; send a string or a list of token ids.")
    if isinstance(req.stop, list) and len(req.stop) > 4:
        raise BadRequest("'stop' takes at most 4 sequences.", "stop")
    if req.max_tokens == 0 and not req.echo:
        raise BadRequest("max_tokens 0 generates nothing; give 1 or more (or echo: true).")
    return req


def prompts_of(req: CompletionRequest, tokenizer: Tokenizer) -> list[list[int]]:
    """The request's prompts as token ids; BadRequest for ids outside the vocabulary."""
    p = req.prompt
    if isinstance(p, str):
        raw: list[str | list[int]] = [p]
    elif all(isinstance(x, int) for x in p):
        raw = [list(p)]  # type: ignore[arg-type]
    else:
        raw = list(p)  # type: ignore[arg-type]
    out = []
    for item in raw:
        if isinstance(item, str):
            out.append(tokenizer.encode(item))
            continue
        bad = [t for t in item if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise BadRequest(
                f"token id {bad[0]} in 'prompt' is outside the vocabulary (0 to "
                f"{tokenizer.vocab_size - 1}); send ids of this model's tokenizer.",
                "prompt",
            )
        out.append(item)
    if len(out) * req.n > MAX_CHOICES:
        raise BadRequest(
            f"{len(out)} prompts x n = {req.n} is {len(out) * req.n} choices, more than "
            f"{MAX_CHOICES}; send fewer at a time.",
            "n",
        )
    return out


def room(service: GenerationService, prompt: list[int]) -> int:
    """Tokens a request may generate after `prompt` (max_tokens null): until the model's context
    or the KV cache is full; BadRequest when the prompt leaves none."""
    limit = min(service.max_seq_len, service.capacity)
    if len(prompt) >= limit:
        raise BadRequest(
            f"the prompt ({len(prompt)} tokens) leaves no room to generate in the model's "
            f"context of {limit} tokens; shorten it.",
            "prompt",
        )
    return limit - len(prompt)


def scoring_fits(service: GenerationService, prompt: list[int]) -> None:
    """A prompt scored with `echo` and max_tokens 0 is run with one token generated and not
    returned (the prompt's logprobs come with it), so it takes one position past the prompt:
    BadRequest, saying so, when the prompt fills the model's context or the KV cache."""
    limit = min(service.max_seq_len, service.capacity)
    if len(prompt) >= limit:
        raise BadRequest(
            f"the prompt ({len(prompt)} tokens) fills the model's context of {limit} tokens; "
            "scoring it (echo with max_tokens 0) takes one position more, for a token computed "
            f"and not returned; shorten it by {len(prompt) - limit + 1} token(s).",
            "prompt",
        )


def sampling_of(
    req: CompletionRequest, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None
) -> SamplingParams:
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_k=req.top_k,
        top_p=req.top_p,
        seed=req.seed,
        stop=tuple(s.encode("utf-8") for s in stops),
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )


def checked_choices(service: GenerationService, req: CompletionRequest) -> list[Choice]:
    """The request's choices, each checked against the engine (RequestRefused, BadRequest), and
    all together against its waiting queue (QueueFull)."""
    prompts = prompts_of(req, service.tokenizer)
    choices = []
    for i, prompt in enumerate(prompts):
        if req.max_tokens == 0:
            scoring_fits(service, prompt)
        limit = room(service, prompt) if req.max_tokens is None else max(1, req.max_tokens)
        params = sampling_of(req, limit, req.logprobs, req.logprobs if req.echo else None)
        service.check(prompt, params)
        for c in expand([prompt], params, req.n, req.echo, req.max_tokens != 0):
            choices.append(replace(c, index=i * req.n + c.index))
    service.admit(len(choices))
    return choices


def _chunk(
    cid: str, created: int, model: str, choices: list[dict[str, Any]], **extra: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": cid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
    }
    return {**body, **extra}


def _choice(
    service: GenerationService, piece: Piece, c: Choice, logprobs: bool, offset: int
) -> dict[str, Any]:
    lps = None
    if logprobs:
        lps = completion_logprobs(service.tokenizer, piece.logprobs, c.prompt, offset)
    return {
        "text": piece.text,
        "index": piece.index,
        "logprobs": lps,
        "finish_reason": piece.finish,
    }


async def complete(
    service: GenerationService, prompt: list[int], params: SamplingParams
) -> tuple[str, int, str | None]:
    """The whole text of one request, its token count and finish reason ("stop", "length")."""
    text, n, finish, reason = "", 0, None, None
    stream = TextStream(params.stop, service.tokenizer)
    async with aclosing(service.generate(prompt, params)) as events:
        async for ev in events:
            if ev.token is not None:
                n += 1
                text += stream.push(ev.token)
            if ev.finish_reason is not None:
                finish, reason = ev.finish_reason, ev.reason
                text += stream.finish(ev.stopped_by)
    if finish == "abort":
        raise Aborted(reason or ABORTED)
    return text, n, finish


async def text_deltas(
    service: GenerationService, prompt: list[int], params: SamplingParams
) -> AsyncGenerator[tuple[str, str | None], None]:
    """(text, None) for every non-empty text delta, then (rest, finish reason) once; raises
    Aborted when the engine stops. Callers close it explicitly (`aclosing`), not leaving it to
    garbage collection, so the engine drops the sequence at once when a client goes away."""
    stream = TextStream(params.stop, service.tokenizer)
    async with aclosing(service.generate(prompt, params)) as events:
        async for ev in events:
            text = stream.push(ev.token) if ev.token is not None else ""
            if ev.finish_reason is None:
                if text:
                    yield text, None
                continue
            if ev.finish_reason == "abort":
                raise Aborted(ev.reason or ABORTED)
            yield text + stream.finish(ev.stopped_by), ev.finish_reason
            return


def mount_openai(app: FastAPI, services: dict[str, GenerationService]) -> None:
    def service_of(name: str, request: Request | None = None) -> GenerationService:
        denied = forbidden_model(request.scope, name, "POST /v1/completions") if request else None
        if denied is not None:  # a token scoped to other models (hpcml.serve.tokens)
            raise BadRequest(denied, "model", 403)
        found = services.get(name)
        if found is None:
            known = ", ".join(sorted(services)) or "none"
            raise BadRequest(
                f"model '{name}' does not generate text here; text models: {known}.",
                "model",
                404,
            )
        return found

    async def completions(request: Request) -> Response:
        try:
            req = parse_request(await request.body())
            service = service_of(req.model, request)
            choices = checked_choices(service, req)
        except BadRequest as exc:
            return error(exc.status, exc.message, exc.param)
        except RequestRefused as exc:
            return error(400, str(exc), "max_tokens")
        except QueueFull as exc:
            return error(429, str(exc))
        cid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        prompts = [c.prompt for c in choices[:: req.n]]
        want_lps = req.logprobs is not None
        if req.stream:
            return StreamingResponse(
                _sse(service, choices, prompts, want_lps, req, cid, created),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        try:
            pieces = await unless_disconnected(request, collect(service, choices))
        except Aborted as exc:
            return error(503, str(exc))
        except Disconnected:
            return Response(status_code=499)  # nobody reads it
        body = [_choice(service, p, c, want_lps, 0) for p, c in zip(pieces, choices, strict=True)]
        tokens = sum(p.tokens for p in pieces)
        return JSONResponse(_chunk(cid, created, req.model, body, usage=usage(prompts, tokens)))

    async def models() -> Response:
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": "hpcml"}
            for name in sorted(services)
        ]
        return JSONResponse({"object": "list", "data": data})

    app.add_api_route(
        "/v1/models",
        models,
        methods=["GET"],
        tags=["generation"],
        summary="OpenAI-compatible list of the models that generate text",
    )
    app.add_api_route(
        "/v1/completions",
        completions,
        methods=["POST"],
        tags=["generation"],
        summary="OpenAI-compatible text completion (stream: true for server-sent events)",
    )


async def _sse(
    service: GenerationService,
    choices: list[Choice],
    prompts: list[list[int]],
    want_lps: bool,
    req: CompletionRequest,
    cid: str,
    created: int,
) -> AsyncIterator[bytes]:
    def event(body: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    with_usage = req.stream_options is not None and req.stream_options.include_usage
    extra: dict[str, Any] = {"usage": None} if with_usage else {}
    offsets = [0] * len(choices)
    tokens = 0
    try:
        async with aclosing(merged(service, choices)) as pieces:
            async for p in pieces:
                c = choices[p.index]
                body = _choice(service, p, c, want_lps, offsets[p.index])
                offsets[p.index] += len(p.text)
                tokens += p.tokens
                yield event(_chunk(cid, created, req.model, [body], **extra))
    except Aborted as exc:
        yield event({"error": {"message": str(exc), "type": "server_error", "param": None}})
    else:
        if with_usage:
            yield event(_chunk(cid, created, req.model, [], usage=usage(prompts, tokens)))
    yield b"data: [DONE]\n\n"
