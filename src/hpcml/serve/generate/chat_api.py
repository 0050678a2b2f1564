"""`POST /v1/chat/completions` (OpenAI's Chat Completions API) and the Open Inference Protocol's
generate extension (`POST /v2/models/{name}/generate` and `/generate_stream`), over the same
generation services and engine as `/v1/completions`.

Chat messages become one prompt through the model's own chat template when its tokenizer has
one (`chat_template` of the `tokenizer_config.json` that `hpcml model import-hf` read, a Jinja
template rendered in a sandbox with `add_generation_prompt`, as Hugging Face's
`apply_chat_template` does), else through one documented template (the zoo's byte-level models
have none of their own)::

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n{content}\\n ... <|assistant|>\\n

each message as a role tag line and its content, then the assistant tag the reply continues.
`<|` starts no sequence the models give a meaning to: it is plain bytes to them. Without
`max_tokens` (or `max_completion_tokens`) the reply may run until the model's context is full,
as OpenAI's does. `n`, `logprobs`/`top_logprobs`, penalties and `stream_options.include_usage`
work as for completions; `logit_bias`, `tools` and a `response_format` other than text are
refused in one sentence.

The generate extension follows Triton's and KServe's documents: the request is a JSON object
with `text_input` and optional `parameters` (`max_tokens`, `temperature`, `top_p`, `top_k`,
`seed`, `stop`); the answer has `model_name`, `model_version`, `text_output` and `details`
(`finish_reason`, `output_tokens`); `generate_stream` sends one such object per text delta as
server-sent events. Errors are the OIP's `{"error": message}`: 400 for a bad body, 404 for a
model that does not generate text.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import replace
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from hpcml.serve.generate.choices import (
    Aborted,
    Choice,
    chat_logprobs,
    collect,
    expand,
    merged,
    usage,
)
from hpcml.serve.generate.disconnect import Disconnected, unless_disconnected
from hpcml.serve.generate.engine import RequestRefused
from hpcml.serve.generate.openai_api import (
    MAX_CHOICES,
    BadRequest,
    M,
    Stop,
    StreamOptions,
    complete,
    error,
    load_body,
    room,
    text_deltas,
    validate,
)
from hpcml.serve.generate.sampling import SamplingParams
from hpcml.serve.generate.service import GenerationService, QueueFull
from hpcml.serve.tokens import forbidden_model


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]
    name: str | None = None


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=0)
    seed: int | None = Field(None, ge=0, le=2**64 - 1)
    stop: Stop | list[Stop] | None = None
    stream: bool = False
    user: str | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    stream_options: StreamOptions | None = None
    # Accepted only at their neutral values.
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None


NEUTRAL: dict[str, tuple[Any, ...]] = {
    "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
}


class GenerateParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=0)
    seed: int | None = Field(None, ge=0, le=2**64 - 1)
    stop: Stop | list[Stop] | None = None
    stream: bool | None = None  # Triton clients send it; the endpoint decides


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text_input: str
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)
    id: str | None = None


def _text(m: Message) -> str:
    return m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)


def render_chat(messages: list[Message], tokenizer: Any = None) -> str:
    """The prompt of a conversation: the tokenizer's own chat template when it has one, else
    the template of the module docstring."""
    template = getattr(tokenizer, "chat_template", None)
    if template:
        return render_template(template, messages, tokenizer)
    out = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        out.append(f"<|{role}|>\n{_text(m)}\n")
    return "".join(out) + "<|assistant|>\n"


def render_template(template: str, messages: list[Message], tokenizer: Any) -> str:
    """A Hugging Face chat template rendered in Jinja's immutable sandbox (no attribute of a
    Python object it was not given, no mutation), as `apply_chat_template` does."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise BadRequest(f"the model's chat template refused the messages: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(
            messages=[{"role": m.role, "content": _text(m)} for m in messages],
            add_generation_prompt=True,
            bos_token=getattr(tokenizer, "bos_text", None) or "",
            eos_token=getattr(tokenizer, "eos_text", None) or "",
        )
    except TemplateError as exc:
        raise BadRequest(
            f"the model's chat template (its tokenizer_config.json) cannot be rendered: {exc}; "
            "fix the template and import the model again."
        ) from None


def _validated(model: type[M], body: bytes) -> M:
    return validate(model, load_body(body))


def _sampling(
    max_tokens: int, temperature: float, top_p: float, top_k: int, seed: int | None, stop: Any
) -> SamplingParams:
    stops = [stop] if isinstance(stop, str) else (stop or [])
    if len(stops) > 4:
        raise BadRequest("'stop' takes at most 4 sequences.", "stop")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        stop=tuple(s.encode("utf-8") for s in stops),
    )


def parse_chat(body: bytes) -> ChatRequest:
    req: ChatRequest = _validated(ChatRequest, body)
    for name, allowed in NEUTRAL.items():
        if getattr(req, name) not in allowed:
            raise BadRequest(
                f"parameter '{name}' = {getattr(req, name)!r} is not supported by this server; "
                "leave it out.",
                name,
            )
    if req.max_tokens and req.max_completion_tokens and req.max_tokens != req.max_completion_tokens:
        raise BadRequest("give max_tokens or max_completion_tokens, not two different values.")
    if req.top_logprobs and not req.logprobs:
        raise BadRequest("top_logprobs needs logprobs: true.", "top_logprobs")
    return req


def chat_choices(service: GenerationService, req: ChatRequest) -> list[Choice]:
    """The request's n choices, checked against the engine (RequestRefused, BadRequest) and its
    waiting queue (QueueFull)."""
    prompt = service.tokenizer.encode(render_chat(req.messages, service.tokenizer))
    limit = req.max_completion_tokens or req.max_tokens or room(service, prompt)
    params = replace(
        _sampling(limit, req.temperature, req.top_p, req.top_k, req.seed, req.stop),
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        logprobs=(req.top_logprobs or 0) if req.logprobs else None,
    )
    service.check(prompt, params)
    service.admit(req.n)
    return expand([prompt], params, req.n, echo=False, keep=True)


def mount_chat_and_generate(app: FastAPI, services: dict[str, GenerationService]) -> None:
    def service_of(name: str, request: Request | None = None) -> GenerationService:
        denied = forbidden_model(request.scope, name, "POST /v1/chat/completions") if request else None
        if denied is not None:  # a token scoped to other models (hpcml.serve.tokens)
            raise BadRequest(denied, "model", 403)
        found = services.get(name)
        if found is None:
            known = ", ".join(sorted(services)) or "none"
            raise BadRequest(
                f"model '{name}' does not generate text here; text models: {known}.", "model", 404
            )
        return found

    async def chat(request: Request) -> Response:
        try:
            req = parse_chat(await request.body())
            service = service_of(req.model, request)
            choices = chat_choices(service, req)
        except BadRequest as exc:
            return error(exc.status, exc.message, exc.param)
        except RequestRefused as exc:
            return error(400, str(exc), "max_tokens")
        except QueueFull as exc:
            return error(429, str(exc))
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            return StreamingResponse(
                _chat_sse(service, choices, req, cid, created),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        try:
            pieces = await unless_disconnected(request, collect(service, choices))
        except Aborted as exc:
            return error(503, str(exc))
        except Disconnected:
            return Response(status_code=499)  # nobody reads it
        body = {
            "id": cid,
            "object": "chat.completion",
            "created": created,
            "model": req.model,
            "choices": [
                {
                    "index": p.index,
                    "message": {"role": "assistant", "content": p.text},
                    "logprobs": chat_logprobs(service.tokenizer, p.logprobs)
                    if req.logprobs
                    else None,
                    "finish_reason": p.finish,
                }
                for p in pieces
            ],
            "usage": usage([choices[0].prompt], sum(p.tokens for p in pieces)),
        }
        return JSONResponse(body)

    async def generate(request: Request, name: str, stream: bool) -> Response:
        try:
            service = service_of(name)
            req: GenerateRequest = _validated(GenerateRequest, await request.body())
            p = req.parameters
            params = _sampling(p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.stop)
            prompt = service.tokenizer.encode(req.text_input)
            service.check(prompt, params)
            service.admit(1)
        except BadRequest as exc:
            return JSONResponse({"error": exc.message}, status_code=exc.status)
        except RequestRefused as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        except QueueFull as exc:
            return JSONResponse({"error": str(exc)}, status_code=429, headers={"Retry-After": "1"})
        head = {"model_name": name, "model_version": service.version}
        if req.id is not None:
            head["id"] = req.id
        if stream:
            return StreamingResponse(
                _generate_sse(service, prompt, params, head),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        try:
            out, n, finish = await unless_disconnected(request, complete(service, prompt, params))
        except Aborted as exc:
            return JSONResponse({"error": str(exc)}, status_code=503, headers={"Retry-After": "1"})
        except Disconnected:
            return Response(status_code=499)  # nobody reads it
        details = {"finish_reason": finish, "output_tokens": n}
        return JSONResponse({**head, "text_output": out, "details": details})

    async def generate_once(request: Request, name: str) -> Response:
        return await generate(request, name, stream=False)

    async def generate_stream(request: Request, name: str) -> Response:
        return await generate(request, name, stream=True)

    app.add_api_route(
        "/v1/chat/completions",
        chat,
        methods=["POST"],
        tags=["generation"],
        summary="OpenAI-compatible chat completion (stream: true for server-sent events)",
    )
    for path, fn, what in (
        ("/v2/models/{name}/generate", generate_once, "one answer"),
        ("/v2/models/{name}/generate_stream", generate_stream, "server-sent events"),
    ):
        app.add_api_route(
            path,
            fn,
            methods=["POST"],
            tags=["generation"],
            summary=f"OIP generate extension: text_input in, text_output out ({what})",
        )


def _event(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"


async def _chat_sse(
    service: GenerationService, choices: list[Choice], req: ChatRequest, cid: str, created: int
) -> AsyncIterator[bytes]:
    with_usage = req.stream_options is not None and req.stream_options.include_usage
    extra: dict[str, Any] = {"usage": None} if with_usage else {}

    def chunk(choices: list[dict[str, Any]], **more: Any) -> bytes:
        head = {"id": cid, "object": "chat.completion.chunk", "created": created}
        return _event({**head, "model": req.model, "choices": choices, **extra, **more})

    def choice(index: int, delta: dict[str, Any], finish: str | None, lps: Any = None) -> Any:
        return {"index": index, "delta": delta, "logprobs": lps, "finish_reason": finish}

    for c in choices:
        yield chunk([choice(c.index, {"role": "assistant", "content": ""}, None)])
    tokens = 0
    try:
        async with aclosing(merged(service, choices)) as pieces:
            async for p in pieces:
                tokens += p.tokens
                lps = chat_logprobs(service.tokenizer, p.logprobs) if req.logprobs else None
                if p.text or (lps and lps["content"]):
                    yield chunk([choice(p.index, {"content": p.text}, None, lps)])
                if p.finish is not None:
                    yield chunk([choice(p.index, {}, p.finish)])
    except Aborted as exc:
        yield _event({"error": {"message": str(exc), "type": "server_error", "param": None}})
    else:
        if with_usage:
            yield chunk([], usage=usage([choices[0].prompt], tokens))
    yield b"data: [DONE]\n\n"


async def _generate_sse(
    service: GenerationService, prompt: list[int], params: SamplingParams, head: dict[str, Any]
) -> AsyncIterator[bytes]:
    try:
        async with aclosing(text_deltas(service, prompt, params)) as deltas:
            async for text, finish in deltas:
                body = {**head, "text_output": text}
                if finish is not None:
                    body["details"] = {"finish_reason": finish}
                yield _event(body)
    except Aborted as exc:
        yield _event({"error": str(exc)})
