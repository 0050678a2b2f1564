"""`POST /v1/completions`, OpenAI-compatible, over the generation services of a server.

The request and answer follow OpenAI's legacy Completions API (what the official `openai`
client's `client.completions.create` sends and reads); `stream: true` answers with
server-sent events, one `text_completion` chunk per text delta and `data: [DONE]` at the end.
`top_k` is an extension (as in vLLM). Parameters this server does not implement (n > 1, echo,
logprobs, penalties, best_of, suffix, logit_bias) are refused with 400 rather than ignored, in
OpenAI's error shape `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Annotated, Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hpcml.serve.generate.disconnect import Disconnected, unless_disconnected
from hpcml.serve.generate.engine import RequestRefused
from hpcml.serve.generate.sampling import SamplingParams, TextStream
from hpcml.serve.generate.service import GenerationService, QueueFull

Stop = Annotated[str, Field(min_length=1)]
M = TypeVar("M", bound=BaseModel)


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    prompt: str | list[str]
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=0)
    seed: int | None = Field(None, ge=0, le=2**64 - 1)  # torch.Generator.manual_seed's range
    stop: Stop | list[Stop] | None = Field(None)
    stream: bool = False
    user: str | None = None
    # OpenAI parameters accepted only at their neutral values.
    n: int = 1
    best_of: int | None = None
    echo: bool = False
    logprobs: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    suffix: str | None = None
    stream_options: dict[str, Any] | None = None


NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "best_of": (None, 1),
    "echo": (False,),
    "logprobs": (None,),
    "frequency_penalty": (0.0,),
    "presence_penalty": (0.0,),
    "logit_bias": (None, {}),
    "suffix": (None, ""),
    "stream_options": (None, {}),
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
    if isinstance(req.prompt, list) and len(req.prompt) != 1:
        raise BadRequest("'prompt' must be one string (a list of several is not supported).")
    if isinstance(req.stop, list) and len(req.stop) > 4:
        raise BadRequest("'stop' takes at most 4 sequences.", "stop")
    return req


def sampling_of(req: CompletionRequest) -> SamplingParams:
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    return SamplingParams(
        max_tokens=req.max_tokens,
        temperature=req.temperature,
        top_k=req.top_k,
        top_p=req.top_p,
        seed=req.seed,
        stop=tuple(s.encode("utf-8") for s in stops),
    )


def _chunk(
    cid: str, created: int, model: str, text: str, finish: str | None, usage: Any = None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": cid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}],
    }
    if usage is not None:
        body["usage"] = usage
    return body


class Aborted(Exception):
    """The engine stopped generating; its message names why."""


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


ABORTED = (
    "the server stopped generating this request (it is shutting down, or its generation process "
    "died and is being restarted); retry."
)


def mount_openai(app: FastAPI, services: dict[str, GenerationService]) -> None:
    def service_of(name: str) -> GenerationService:
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
            service = service_of(req.model)
            prompt_text = req.prompt if isinstance(req.prompt, str) else req.prompt[0]
            prompt = service.tokenizer.encode(prompt_text)
            params = sampling_of(req)
            service.check(prompt, params)
        except BadRequest as exc:
            return error(exc.status, exc.message, exc.param)
        except RequestRefused as exc:
            return error(400, str(exc), "max_tokens")
        except QueueFull as exc:
            return error(429, str(exc))
        cid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if req.stream:
            return StreamingResponse(
                _sse(service, prompt, params, cid, created, req.model),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        try:
            text, n, finish = await unless_disconnected(request, complete(service, prompt, params))
        except Aborted as exc:
            return error(503, str(exc))
        except Disconnected:
            return Response(status_code=499)  # nobody reads it
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": n,
            "total_tokens": len(prompt) + n,
        }
        return JSONResponse(_chunk(cid, created, req.model, text, finish, usage))

    app.add_api_route(
        "/v1/completions",
        completions,
        methods=["POST"],
        tags=["generation"],
        summary="OpenAI-compatible text completion (stream: true for server-sent events)",
    )


async def _sse(
    service: GenerationService,
    prompt: list[int],
    params: SamplingParams,
    cid: str,
    created: int,
    model: str,
) -> AsyncIterator[bytes]:
    def event(body: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    try:
        async with aclosing(text_deltas(service, prompt, params)) as deltas:
            async for text, finish in deltas:
                yield event(_chunk(cid, created, model, text, finish))
    except Aborted as exc:
        yield event({"error": {"message": str(exc), "type": "server_error", "param": None}})
    yield b"data: [DONE]\n\n"
