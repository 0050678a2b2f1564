"""A bound on how long a client may take to send a request's headers (uvicorn has none).

A connection that opens and sends its headers a byte at a time never reaches the app, so no
ASGI limit sees it; each one holds a socket for as long as the client likes. uvicorn's
httptools protocol is extended with one timer: armed when a connection opens and when a request
begins, cancelled once its headers are complete; if it fires first, the connection is closed.
The body has its own bound (`body_timeout_s`, in `limits.BodyLimit`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


def header_timeout_protocol(timeout_s: float) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol closing connections whose headers take over `timeout_s`."""

    class HeaderTimeoutProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(timeout_s, self._headers_late)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._header_timer is None:
                self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

    return HeaderTimeoutProtocol
