"""Inference requests straight to their handler, past the framework's per-request layers.

FastAPI's documented inference routes stay (they make the OpenAPI document), but requests are
answered here: a pure ASGI layer placed innermost, inside the body and concurrency limits, that
matches `POST /v2/models/{name}[/versions/{version}]/infer` and calls the handler. Skipped are
the exception middleware, the per-request exit stack, route matching over every route and the
request/response wrapper: about a quarter of a batched binary request's event-loop CPU
(benchmarks/serving_cpu.py). Errors keep their form: the handler answers every
failure itself, and a bug still reaches the outer error middleware (a JSON 500). Any other
method or path goes on to the app.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

# Starlette's own pattern for a `{param}` path segment is `[^/]+`.
INFER_PATH = re.compile(r"/v2/models/(?P<name>[^/]+)(?:/versions/(?P<version>[^/]+))?/infer")

Handler = Callable[[Request, str, str | None], Awaitable[Response]]


class InferRoute:
    """Pure ASGI: `POST` to an inference path goes to `handler(request, name, version)`."""

    def __init__(self, app: Any, handler: Handler) -> None:
        self.app = app
        self.handler = handler

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            match = INFER_PATH.fullmatch(scope["path"])
            if match is not None:
                name, version = match.group("name", "version")
                scope["path_params"] = {"name": name, **({"version": version} if version else {})}
                response = await self.handler(Request(scope, receive), name, version)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
