"""Stop work whose client has gone: a non-streamed answer awaited while the connection is
watched.

A streamed answer stops when its client goes away (Starlette cancels the response when the
server reports the disconnect, and the token generator's `aclosing` aborts the sequence). A
non-streamed one has no such hook: the handler would go on awaiting the whole generation. Once
its body is read, an ASGI request's next `receive()` returns only at `http.disconnect`, so
`unless_disconnected` races the answer against that message and cancels the answer when it
comes; cancelling closes the token generator, which sends the engine its abort at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from starlette.requests import Request

T = TypeVar("T")


class Disconnected(Exception):
    """The client closed the connection before the answer was ready (nobody to answer)."""


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """`await work`, cancelled (raising Disconnected) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if not task.done():
        await asyncio.wait((task,))  # its generator closes: the engine gets the abort now
        raise Disconnected
    return task.result()
