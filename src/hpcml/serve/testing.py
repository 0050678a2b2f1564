"""Run a server on a free loopback port inside this process, for tests, notebooks, benchmarks.

The app runs under a real uvicorn in a background thread, with its lifespan (model loading,
batcher draining) exactly as `hpcml serve` runs it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from hpcml.errors import WorkFailed
from hpcml.serve.protocol.app import bind_socket


@contextmanager
def running_server(
    app: Any, host: str = "127.0.0.1", startup_timeout_s: float = 120.0
) -> Iterator[str]:
    """Yield the base URL (http://127.0.0.1:PORT, https:// under `tls`) while `app` is served."""
    import uvicorn

    sock = bind_socket(host, 0)
    port = sock.getsockname()[1]
    from hpcml.serve.protocol.app import http_protocol, tls_options

    config = getattr(app.state, "config", None)
    http = http_protocol(config) if config is not None else "auto"
    tls = tls_options(config) if config is not None else {}
    server = uvicorn.Server(
        uvicorn.Config(
            app, log_level="warning", access_log=False, timeout_graceful_shutdown=30, http=http,
            **tls,
        )  # fmt: skip
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive():
            raise WorkFailed("the server stopped during startup; see the log above.")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise WorkFailed(f"the server did not start within {startup_timeout_s:g} s.")
        time.sleep(0.02)
    try:
        yield f"{'https' if tls else 'http'}://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()
