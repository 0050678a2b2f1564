"""The token gate of the HTTP server: every request is let in, or answered 401 / 403 / 429 in
one sentence, before anything else reads it (`hpcml.serve.tokens` decides).

A pure ASGI layer, outermost, so a refused request costs no body read and no concurrency
slot. The caller it lets in is left in the scope's state (`tokens.PRINCIPAL_KEY`) for the
handlers that name it (the audit log) or check a model named in the body (/v1/completions).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

from hpcml.serve.codec import oip
from hpcml.serve.tokens import (
    PRINCIPAL_KEY,
    Authorizer,
    Refusal,
    bearer,
    model_in_path,
    required_role,
)


class TokenGate:
    def __init__(
        self, app: Any, authorizer: Authorizer, on_refused: Callable[[str, int], None]
    ) -> None:
        self.app, self.authorizer, self.on_refused = app, authorizer, on_refused

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method, path = scope["method"], scope["path"]
        if not self.authorizer.tokens_file and not path.startswith("/admin"):
            await self.app(scope, receive, send)  # open as before roles: nothing to check
            return
        token = None
        for key, value in scope["headers"]:
            if key == b"authorization":
                token = bearer(value.decode("latin-1"))
        try:
            principal = self.authorizer.check(
                token, required_role(method, path), model_in_path(path), f"{method} {path[:200]}"
            )
        except Refusal as refusal:
            await self.refuse(refusal, scope, send)
            self.on_refused(path, refusal.status)
            return
        scope.setdefault("state", {})[PRINCIPAL_KEY] = principal
        await self.app(scope, receive, send)

    @staticmethod
    async def refuse(refusal: Refusal, scope: Any, send: Any) -> None:
        """The refusal in the error form of the endpoint's protocol: OpenAI's under /v1/,
        the Open Inference Protocol's elsewhere."""
        headers = [(b"content-type", b"application/json")]
        if refusal.status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        if refusal.retry_after_s is not None:
            headers.append((b"retry-after", str(math.ceil(refusal.retry_after_s)).encode()))
        if scope["path"].startswith("/v1/"):
            error = {"message": refusal.message, "type": "invalid_request_error",
                     "param": None, "code": None}  # fmt: skip
            body = json.dumps({"error": error}).encode()
        else:
            body = oip.error_body(refusal.message)
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": refusal.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
