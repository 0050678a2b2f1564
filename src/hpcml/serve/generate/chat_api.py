"""`POST /v1/chat/completions` (OpenAI's Chat Completions API) and the Open Inference Protocol's
generate extension (`POST /v2/models/{name}/generate` and `/generate_stream`), over the same
generation services and engine as `/v1/completions`.

Chat messages become one prompt through one documented template (the zoo's byte-level models
have no chat template of their own)::

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n{content}\\n ... <|assistant|>\\n

each message as a role tag line and its content, then the assistant tag the reply continues.
`<|` starts no sequence the models give a meaning to: it is plain bytes to them.

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
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from hpcml.serve.generate.disconnect import Disconnected, unless_disconnected
from hpcml.serve.generate.engine import RequestRefused
from hpcml.serve.generate.openai_api import (
    Aborted,
    BadRequest,
    M,
    Stop,
    complete,
    error,
    load_body,
    text_deltas,
    validate,
)
from hpcml.serve.generate.sampling import SamplingParams
from hpcml.serve.generate.service import GenerationService, QueueFull


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
    # Accepted only at their neutral values.
    n: int = 1
    logprobs: bool | None = None
    top_logprobs: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    stream_options: dict[str, Any] | None = None


NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "frequency_penalty": (0.0,),
    "presence_penalty": (0.0,),
    "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "stream_options": (None, {}),
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


def render_chat(messages: list[Message]) -> str:
    """The template of the module docstring."""
    out = []
    for m in messages:
        text = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)
        role = "system" if m.role == "developer" else m.role
        out.append(f"<|{role}|>\n{text}\n")
    return "".join(out) + "<|assistant|>\n"


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


def parse_chat(body: bytes) -> tuple[ChatRequest, str, SamplingParams]:
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
    limit = req.max_completion_tokens or req.max_tokens or 16
    params = _sampling(limit, req.temperature, req.top_p, req.top_k, req.seed, req.stop)
    return req, render_chat(req.messages), params


def mount_chat_and_generate(app: FastAPI, services: dict[str, GenerationService]) -> None:
    def service_of(name: str) -> GenerationService:
        found = services.get(name)
        if found is None:
            known = ", ".join(sorted(services)) or "none"
            raise BadRequest(
                f"model '{name}' does not generate text here; text models: {known}.", "model", 404
            )
        return found

    async def chat(request: Request) -> Response:
        try:
            req, text, params = parse_chat(await request.body())
            service = service_of(req.model)
            prompt = service.tokenizer.encode(text)
            service.check(prompt, params)
        except BadRequest as exc:
            return error(exc.status, exc.message, exc.param)
        except RequestRefused as exc:
            return error(400, str(exc), "max_tokens")
        except QueueFull as exc:
            return error(429, str(exc))
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            return StreamingResponse(
                _chat_sse(service, prompt, params, cid, created, req.model),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        try:
            out, n, finish = await unless_disconnected(request, complete(service, prompt, params))
        except Aborted as exc:
            return error(503, str(exc))
        except Disconnected:
            return Response(status_code=499)  # nobody reads it
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": out},
            "logprobs": None,
            "finish_reason": finish,
        }
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": n,
            "total_tokens": len(prompt) + n,
        }
        body = {
            "id": cid,
            "object": "chat.completion",
            "created": created,
            "model": req.model,
            "choices": [choice],
            "usage": usage,
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
    service: GenerationService,
    prompt: list[int],
    params: SamplingParams,
    cid: str,
    created: int,
    model: str,
) -> AsyncIterator[bytes]:
    def chunk(delta: dict[str, Any], finish: str | None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return _event(
            {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [choice],
            }
        )

    yield chunk({"role": "assistant", "content": ""}, None)
    try:
        async with aclosing(text_deltas(service, prompt, params)) as deltas:
            async for text, finish in deltas:
                if text:
                    yield chunk({"content": text}, None)
                if finish is not None:
                    yield chunk({}, finish)
    except Aborted as exc:
        yield _event({"error": {"message": str(exc), "type": "server_error", "param": None}})
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
