"""Pure ASGI limits in front of the app: request body size and time, and requests in flight.

All answer in the protocol's error form (`{"error": "..."}`) without reading the body, and
both are plain ASGI (no copy of the body, no per-request task) because they sit on every
request's path.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from hpcml.serve.codec.oip import error_body

JSON = "application/json"
ASGIApp = Callable[
    [MutableMapping[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]],
    Awaitable[None],
]


async def send_error(
    send: Callable[[Any], Awaitable[None]],
    status: int,
    message: str,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    body = error_body(message)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", JSON.encode()),
                (b"content-length", str(len(body)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class BodyTooLarge(Exception):
    """Raised by the receive channel once the body passes the limit; routes may turn it into
    their own 413 (the inference route does, so the request is counted in the metrics)."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(
            f"request body is larger than the server's limit of {max_bytes} bytes; "
            "send fewer samples per request."
        )


class BodyTooSlow(Exception):
    """Raised by the receive channel when the body has not arrived within the time allowed."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(
            f"the request body did not arrive within {timeout_s:g} s (body_timeout_s); send it "
            "at once."
        )


class BodyLimit:
    """Answer 413 for bodies over the limit, before reading them whole (pure ASGI: no copy),
    and 408 for bodies not received within `timeout_s` of the request's start, so slow
    clients cannot hold the server's concurrency slots."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        timeout_s: float | None = None,
        on_refused: Callable[[str, int], None] | None = None,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.on_refused = on_refused
        """Called with (path, status) for each request refused here, unseen by the routes."""

    async def _reject(self, send: Callable[[Any], Awaitable[None]], exc: Exception) -> None:
        await send_error(send, 413 if isinstance(exc, BodyTooLarge) else 408, str(exc))

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for key, value in scope["headers"]:
            if key == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                if self.on_refused is not None:
                    self.on_refused(scope["path"], 413)
                await self._reject(send, BodyTooLarge(self.max_bytes))
                return
        received = 0
        started = False
        # Until the body is complete; later receives wait for a disconnect (streaming answers).
        deadline = None
        if self.timeout_s is not None:
            deadline = asyncio.get_running_loop().time() + self.timeout_s

        async def limited_receive() -> Any:
            nonlocal received, deadline
            if deadline is None:
                message = await receive()
            else:
                try:
                    async with asyncio.timeout_at(deadline):
                        message = await receive()
                except TimeoutError:
                    assert self.timeout_s is not None
                    raise BodyTooSlow(self.timeout_s) from None
                if message["type"] != "http.request" or not message.get("more_body", False):
                    deadline = None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        async def tracking_send(message: Any) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except (BodyTooLarge, BodyTooSlow) as exc:
            if not started:
                await self._reject(send, exc)


# Probes and scrapes must answer while the server is saturated, or an orchestrator would take
# a busy replica for a dead one: server health, metrics, and each model's readiness.
_EXEMPT_PREFIXES = ("/v2/health/", "/metrics")


def _exempt(path: str) -> bool:
    return path.startswith(_EXEMPT_PREFIXES) or (
        path.startswith("/v2/models/") and path.endswith("/ready")
    )


class ConcurrencyLimit:
    """Answer 503 + Retry-After at once when `limit` requests are already in flight."""

    def __init__(
        self,
        app: ASGIApp,
        limit: int,
        retry_after_s: int,
        on_refused: Callable[[str, int], None] | None = None,
    ) -> None:
        self.app = app
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.in_flight = 0
        self.on_refused = on_refused

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or _exempt(scope["path"]):
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.limit:
            if self.on_refused is not None:
                self.on_refused(scope["path"], 503)
            await send_error(
                send,
                503,
                f"the server is handling its limit of {self.limit} concurrent requests; "
                "retry later.",
                [(b"retry-after", str(self.retry_after_s).encode())],
            )
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
