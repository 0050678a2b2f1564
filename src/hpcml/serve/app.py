"""The HTTP server: Open Inference Protocol v2 REST endpoints, admin endpoints and /metrics.

`create_app` wires a `Router` into a FastAPI app whose lifespan loads the models and, on
shutdown, drains the batchers after uvicorn has let in-flight requests finish. Every error is
`{"error": "..."}` as the protocol asks. Inference bodies are read as bytes and parsed by
`protocol` (no per-request pydantic validation: tensors can hold thousands of numbers).
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import os
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import Body, Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException
from starlette.routing import Route

import hpcml
from hpcml.serve import protocol as oip
from hpcml.serve.batcher import (
    BackendFailed,
    BatcherClosed,
    QueueFull,
    RequestTimeout,
    WorkerLost,
)
from hpcml.serve.config import ServeConfig
from hpcml.serve.metrics import ServeMetrics
from hpcml.serve.router import ModelVersion, NotFound, PolicyError, Router

JSON = "application/json"
ASGIApp = Callable[
    [MutableMapping[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]],
    Awaitable[None],
]


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return Response(oip.error_body(message), status_code=status, media_type=JSON, headers=headers)


class _BodyTooLarge(Exception):
    pass


class BodyLimit:
    """Answer 413 for bodies over the limit, before reading them whole (pure ASGI: no copy)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def _reject(self, send: Callable[[Any], Awaitable[None]]) -> None:
        body = oip.error_body(
            f"request body is larger than the server's limit of {self.max_bytes} bytes; "
            "send fewer samples per request."
        )
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", JSON.encode()),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for key, value in scope["headers"]:
            if key == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await self._reject(send)
                return
        received = 0
        started = False

        async def limited_receive() -> Any:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge()
            return message

        async def tracking_send(message: Any) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await self._reject(send)


class TrafficBody(BaseModel):
    weights: dict[str, float] = Field(description='Version -> weight, e.g. {"1": 90, "2": 10}.')


class PromoteBody(BaseModel):
    version: str


class ShadowBody(BaseModel):
    version: str | None = Field(description="Candidate version; null turns shadowing off.")
    fraction: float = Field(1.0, gt=0.0, le=1.0)


def create_app(router: Router, config: ServeConfig, metrics: ServeMetrics) -> FastAPI:
    admin_token = os.environ.get(config.admin_token_env) if config.admin_token_env else None

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await router.start()
        # Everything allocated so far (torch, FastAPI, models) lives as long as the server;
        # frozen, the cyclic GC stops rescanning it, which otherwise shows up as p99 spikes.
        gc.freeze()
        yield
        await router.close()

    app = FastAPI(
        title="hpcml serve",
        version=hpcml.__version__,
        description="Open Inference Protocol v2 (KServe / Triton REST) with dynamic batching.",
        lifespan=lifespan,
    )
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    app.state.router = router
    app.state.metrics = metrics

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, exc: HTTPException) -> Response:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = "no such endpoint; see /docs for the API."
        return _error(exc.status_code, message, dict(exc.headers or {}))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> Response:
        e = exc.errors()[0]
        where = ".".join(str(p) for p in e["loc"])
        return _error(400, f"{where}: {e['msg']}.")

    def overloaded(mv: ModelVersion) -> Response:
        msg = (
            f"model '{mv.model}' version {mv.version} is overloaded: its queue holds "
            f"{mv.batcher.queue_depth} samples (limit {mv.batcher.max_queue_size}); retry later."
        )
        if config.overload_status == 429:
            return _error(429, msg, {"Retry-After": str(config.retry_after_s)})
        return _error(503, msg)

    async def infer(request: Request, name: str, version: str | None) -> Response:
        started = time.perf_counter()
        chosen: ModelVersion | None = None
        # Unknown names must not create metric series (any client could invent them).
        label_model = name if name in router.models else ""
        label_version = version or ""
        status = 500
        try:
            # An unknown model or version is a 404 whatever the body holds.
            model = router.model(name)
            if version is not None:
                model.version(version)
            parsed = oip.parse_infer_request(await request.body())

            def prepare(mv: ModelVersion) -> Any:
                nonlocal chosen
                chosen = mv
                x = oip.check_inputs(parsed, mv.input, mv.config.max_batch_size, name)
                oip.check_requested_outputs(parsed, [mv.output], name)
                return x

            mv, result = await router.infer(name, version, prepare)
            status = 200
            return Response(
                oip.infer_response_body(
                    name, mv.version, parsed.request_id, mv.output, result.output
                ),
                media_type=JSON,
            )
        except oip.ProtocolError as exc:
            status = exc.status
            return _error(status, exc.message)
        except NotFound as exc:
            status = 404
            return _error(404, str(exc))
        except QueueFull:
            assert chosen is not None
            response = overloaded(chosen)
            status = response.status_code
            return response
        except RequestTimeout:
            status = 504
            assert chosen is not None
            return _error(
                504, f"request to model '{name}' timed out after {chosen.config.timeout_ms:g} ms."
            )
        except BatcherClosed:
            status = 503
            return _error(503, "the server is shutting down; retry on another replica.")
        except WorkerLost:
            status = 503
            return _error(
                503,
                f"the inference process of model '{name}' died and is being restarted; retry.",
                {"Retry-After": str(config.retry_after_s)},
            )
        except BackendFailed as exc:
            status = 500
            return _error(500, f"model '{name}' failed to compute the batch: {exc}")
        except asyncio.CancelledError:
            status = 499  # the client went away (nginx's code); its queue place is freed
            raise
        finally:
            if chosen is not None:
                label_version = chosen.version
            elif label_version and (
                label_model == "" or label_version not in router.models[name].versions
            ):
                label_version = ""
            if chosen is not None:
                metrics.latency.labels(label_model, label_version).observe(
                    time.perf_counter() - started
                )
            metrics.requests.labels(label_model, label_version, str(status)).inc()

    infer_doc: dict[str, Any] = {
        "openapi_extra": {
            "requestBody": {
                "required": True,
                "content": {JSON: {"schema": {"$ref": "#/components/schemas/InferenceRequest"}}},
            }
        },
        "responses": {
            200: {"model": oip.InferenceResponse},
            400: {"model": oip.ErrorResponse},
            404: {"model": oip.ErrorResponse},
            413: {"model": oip.ErrorResponse},
            429: {"model": oip.ErrorResponse},
            503: {"model": oip.ErrorResponse},
            504: {"model": oip.ErrorResponse},
        },
        "tags": ["inference"],
    }

    @app.post(
        "/v2/models/{name}/infer",
        summary="Inference (newest or traffic-split version)",
        **infer_doc,
    )
    async def infer_model(name: str, request: Request) -> Response:
        return await infer(request, name, None)

    @app.post(
        "/v2/models/{name}/versions/{version}/infer",
        summary="Inference on one version",
        **infer_doc,
    )
    async def infer_version(name: str, version: str, request: Request) -> Response:
        return await infer(request, name, version)

    # The two routes above document inference in the OpenAPI schema; requests are answered by
    # these plain Starlette routes placed before them, which skip FastAPI's per-request
    # dependency solving (about a fifth of a small request's CPU time).
    async def infer_fast(request: Request) -> Response:
        params = request.path_params
        return await infer(request, params["name"], params.get("version"))

    app.router.routes[0:0] = [
        Route(path, infer_fast, methods=["POST"], include_in_schema=False)
        for path in ("/v2/models/{name}/infer", "/v2/models/{name}/versions/{version}/infer")
    ]

    @app.get("/v2/health/live", response_model=oip.ServerHealth, tags=["health"])
    async def live() -> dict[str, Any]:
        return {"live": True}

    @app.get(
        "/v2/health/ready",
        response_model=oip.ServerHealth,
        tags=["health"],
        responses={400: {"model": oip.ServerHealth}},
    )
    async def ready() -> Response:
        ok = router.ready
        return JSONResponse({"ready": ok}, status_code=200 if ok else 400)

    @app.get("/v2", response_model=oip.ServerMetadata, tags=["metadata"])
    async def server_metadata() -> dict[str, Any]:
        return {"name": "hpcml", "version": hpcml.__version__, "extensions": ["model_repository"]}

    def model_metadata(name: str, version: str | None) -> Response:
        try:
            model = router.model(name)
            mv = model.version(version)
        except NotFound as exc:
            return _error(404, str(exc))
        meta = mv.metadata()
        if version is None:
            from hpcml.serve.repository import sorted_versions

            meta["versions"] = sorted_versions(list(model.versions))
        return JSONResponse(meta)

    meta_doc: dict[str, Any] = {
        "response_model": oip.ModelMetadata,
        "responses": {404: {"model": oip.ErrorResponse}},
        "tags": ["metadata"],
    }

    @app.get("/v2/models/{name}", **meta_doc)
    async def model_meta(name: str) -> Response:
        return model_metadata(name, None)

    @app.get("/v2/models/{name}/versions/{version}", **meta_doc)
    async def version_meta(name: str, version: str) -> Response:
        return model_metadata(name, version)

    def model_ready(name: str, version: str | None) -> Response:
        try:
            model = router.model(name)
            ok = (
                model.version(version).ready
                if version
                else all(model.versions[v].ready for v in model.policy.weights)
            )
        except NotFound as exc:
            return _error(404, str(exc))
        return JSONResponse({"name": name, "ready": ok}, status_code=200 if ok else 400)

    ready_doc: dict[str, Any] = {
        "response_model": oip.ModelReady,
        "responses": {400: {"model": oip.ModelReady}, 404: {"model": oip.ErrorResponse}},
        "tags": ["health"],
    }

    @app.get("/v2/models/{name}/ready", **ready_doc)
    async def model_ready_any(name: str) -> Response:
        return model_ready(name, None)

    @app.get("/v2/models/{name}/versions/{version}/ready", **ready_doc)
    async def model_ready_version(name: str, version: str) -> Response:
        return model_ready(name, version)

    @app.get("/metrics", tags=["metrics"], response_class=Response)
    async def prometheus_metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def require_admin(authorization: str | None = Header(None)) -> None:
        if not admin_token:
            raise HTTPException(
                403,
                "admin endpoints are disabled: start the server with admin_token_env naming an "
                "environment variable that holds a token.",
            )
        given = authorization[7:] if authorization and authorization.startswith("Bearer ") else ""
        if not hmac.compare_digest(given.encode(), admin_token.encode()):
            raise HTTPException(
                401,
                "admin endpoints need 'Authorization: Bearer <token>' with the configured token.",
                headers={"WWW-Authenticate": "Bearer"},
            )

    def admin(call: Callable[[], dict[str, Any]]) -> Response:
        try:
            return JSONResponse(call())
        except NotFound as exc:
            return _error(404, str(exc))
        except PolicyError as exc:
            return _error(400, str(exc))

    admin_doc: dict[str, Any] = {"tags": ["admin"], "dependencies": [Depends(require_admin)]}

    @app.get("/admin/models", **admin_doc)
    async def admin_models() -> Response:
        return admin(lambda: {"models": [m.describe() for m in router.models.values()]})

    @app.get("/admin/models/{name}", **admin_doc)
    async def admin_model(name: str) -> Response:
        return admin(lambda: router.model(name).describe())

    @app.post("/admin/models/{name}/traffic", **admin_doc)
    async def admin_traffic(name: str, body: TrafficBody = Body(...)) -> Response:
        return admin(lambda: router.set_traffic(name, body.weights))

    @app.post("/admin/models/{name}/promote", **admin_doc)
    async def admin_promote(name: str, body: PromoteBody = Body(...)) -> Response:
        return admin(lambda: router.promote(name, body.version))

    @app.post("/admin/models/{name}/rollback", **admin_doc)
    async def admin_rollback(name: str) -> Response:
        return admin(lambda: router.rollback(name))

    @app.post("/admin/models/{name}/shadow", **admin_doc)
    async def admin_shadow(name: str, body: ShadowBody = Body(...)) -> Response:
        return admin(lambda: router.set_shadow(name, body.version, body.fraction))

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes
            )
            extra = oip.InferenceRequest.model_json_schema(
                ref_template="#/components/schemas/{model}"
            )
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components.update(extra.pop("$defs", {}))
            components["InferenceRequest"] = extra
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def build_app(
    path: str | Path | None,
    config: ServeConfig,
    name: str | None = None,
    seed: int | None = None,
    trust_code: bool = False,
    follow_poll_s: float | None = None,
) -> FastAPI:
    """The app for PATH (see `resolve_model_source`) with `config`; models load at startup.

    `trust_code` (`--trust-code`) lets a model.json that names an import path run that code;
    `follow_poll_s` makes a `models:/NAME@ALIAS` PATH follow its alias (`--follow`)."""
    from hpcml.errors import ConfigError
    from hpcml.serve.repository import ModelSource, resolve_model_source

    source = (
        resolve_model_source(path, name)
        if path is not None
        else ModelSource("repository", Path("."))
    )
    metrics = ServeMetrics()
    router = Router.from_source(source, config, metrics, seed, trust_code=trust_code)
    if not router.models:
        raise ConfigError(
            "nothing to serve: give a model PATH or versions with paths in the serve config."
        )
    if follow_poll_s is not None:
        from hpcml.serve.follow import follow

        follow(router, str(path), follow_poll_s)
    return create_app(router, config, metrics)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket; port 0 picks a free one (tests, benchmarks)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def uvicorn_server(app: FastAPI, config: ServeConfig, log_level: str = "warning") -> Any:
    import uvicorn

    return uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=log_level,
            access_log=False,
            timeout_graceful_shutdown=int(config.graceful_timeout_s),
            # Clients under load keep connections; a short keep-alive only adds reconnects.
            timeout_keep_alive=30,
            backlog=4096,
        )
    )
