"""The HTTP server: Open Inference Protocol v2 REST endpoints, admin endpoints and /metrics.

`create_app` wires a `Router` into a FastAPI app whose lifespan loads the models, starts the
gRPC endpoint when `grpc_port` is set (`grpc`) and, on shutdown, drains the batchers after
uvicorn has let in-flight requests finish. The token gate (`gate`, with the roles of
`hpcml.serve.tokens`) answers first; the admin endpoints live in `admin`; `tls_options` hands
uvicorn the certificate of `tls`. Every error is `{"error": "..."}` as the protocol asks.
Inference bodies (JSON or binary tensor data) are read as bytes and parsed by `protocol` (no
per-request pydantic validation: tensors can hold thousands of numbers).
"""

from __future__ import annotations

import asyncio
import gc
import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware

import hpcml
from hpcml.serve.codec import oip
from hpcml.serve.config import ServeConfig
from hpcml.serve.metrics import ServeMetrics
from hpcml.serve.protocol import schemas
from hpcml.serve.protocol.admin import add_admin_routes
from hpcml.serve.protocol.gate import TokenGate
from hpcml.serve.protocol.infer_route import InferRoute
from hpcml.serve.protocol.inference import (
    EXTENSIONS,
    InferFailure,
    model_is_ready,
    model_metadata,
    run_infer,
)
from hpcml.serve.protocol.triton_config import add_triton_routes
from hpcml.serve.tokens import Authorizer, load_tokens
from hpcml.serve.traffic.drift import add_drift_routes
from hpcml.serve.traffic.limits import BodyLimit, BodyTooLarge, BodyTooSlow, ConcurrencyLimit
from hpcml.serve.traffic.router import Router
from hpcml.serve.traffic.versions import NotFound

JSON = "application/json"
OCTET = "application/octet-stream"


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return Response(oip.error_body(message), status_code=status, media_type=JSON, headers=headers)


def authorizer_of(config: ServeConfig) -> Authorizer:
    """Who may call what: the tokens file's principals and the `admin_token_env` token."""
    admin_token = os.environ.get(config.admin_token_env) if config.admin_token_env else None
    principals = load_tokens(config.tokens_file) if config.tokens_file else []
    return Authorizer(principals, admin_token)


def create_app(router: Router, config: ServeConfig, metrics: ServeMetrics) -> FastAPI:
    from hpcml.serve.generate.mount import text_services

    authorizer = authorizer_of(config)
    # gpt exports over bytes also generate text (/v1/completions); loaded now, like the CLI
    # loads the router before serving, so a bad export fails before the server starts.
    generators = text_services(router, config, metrics.registry)
    for name, generator in generators.items():
        router.also_ready[name] = generator.is_ready

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await router.start()
        for generator in generators.values():
            await generator.start()
        grpc_endpoint = None
        if config.grpc_port is not None:
            from hpcml.serve.protocol.grpc import start_grpc_server

            grpc_endpoint, app.state.grpc_port = await start_grpc_server(
                router, config, metrics, authorizer
            )
        # Everything allocated so far (torch, FastAPI, models) lives as long as the server;
        # frozen, the cyclic GC stops rescanning it, which otherwise shows up as p99 spikes.
        gc.freeze()
        yield
        if grpc_endpoint is not None:
            await grpc_endpoint.stop(config.graceful_timeout_s)
        for generator in generators.values():
            await generator.close()
        await router.close()

    app = FastAPI(
        title="hpcml serve",
        version=hpcml.__version__,
        description="Open Inference Protocol v2 (KServe / Triton REST) with dynamic batching.",
        lifespan=lifespan,
    )

    def count_refused(path: str, status: int) -> None:
        """Inference requests the limits refuse never reach run_infer: counted here."""
        parts = path.strip("/").split("/")
        # v2/models/NAME/infer or v2/models/NAME/versions/V/infer
        if parts[:2] != ["v2", "models"] or parts[-1:] != ["infer"] or len(parts) not in (4, 6):
            return
        name = parts[2] if parts[2] in router.models else ""
        version = ""
        if name and len(parts) == 6 and parts[4] in router.models[name].versions:
            version = parts[4]
        metrics.requests.labels(name, version, "http", str(status)).inc()

    app.add_middleware(
        BodyLimit,
        max_bytes=config.max_body_bytes,
        timeout_s=config.body_timeout_s,
        on_refused=count_refused,
    )
    if config.limit_concurrency is not None:
        # Added last, so it runs first: a refused request costs no body read.
        app.add_middleware(
            ConcurrencyLimit,
            limit=config.limit_concurrency,
            retry_after_s=config.retry_after_s,
            on_refused=count_refused,
        )
    # Added last of all, so it runs first: a caller without the role costs nothing more.
    app.add_middleware(TokenGate, authorizer=authorizer, on_refused=count_refused)
    metrics.watch_readiness(
        lambda: [(mv.model, mv.version, mv.ready) for mv in router.all_versions()]
    )
    app.state.router = router
    app.state.metrics = metrics
    app.state.config = config
    app.state.authorizer = authorizer
    add_drift_routes(app, router.drift)
    app.state.grpc_port = None
    app.state.generators = generators
    if generators:
        from hpcml.serve.generate.chat_api import mount_chat_and_generate
        from hpcml.serve.generate.openai_api import mount_openai

        mount_openai(app, generators)
        mount_chat_and_generate(app, generators)

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, exc: HTTPException) -> Response:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = "no such endpoint; see /docs for the API."
        return _error(exc.status_code, message, dict(exc.headers or {}))

    @app.exception_handler(Exception)
    async def _unexpected_error(_: Request, exc: Exception) -> Response:
        # A bug of ours: Starlette logs the traceback after this answer; the client still gets
        # the protocol's JSON error form, never a plain-text page.
        return _error(500, f"internal error ({type(exc).__name__}); see the server log.")

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> Response:
        e = exc.errors()[0]
        where = ".".join(str(p) for p in e["loc"])
        return _error(400, f"{where}: {e['msg']}.")

    async def read_infer_body(request: Request) -> oip.InferRequest:
        headers = request.headers
        content_type = headers.get("content-type", "").split(";")[0].strip().lower()
        if content_type not in ("", JSON, OCTET) and not content_type.endswith("+json"):
            raise oip.ProtocolError(
                f"content type {content_type[:60]!r} is not accepted; send {JSON} (or "
                f"{OCTET} with binary tensor data)."
            )
        encoding = headers.get("content-encoding", "identity").strip().lower()
        if encoding != "identity":
            raise oip.ProtocolError(
                f"content encoding {encoding[:40]!r} is not supported; send the body uncompressed."
            )
        try:
            body = await request.body()
        except BodyTooLarge as exc:
            raise oip.ProtocolError(str(exc), status=413) from None
        except BodyTooSlow as exc:
            raise oip.ProtocolError(str(exc), status=408) from None
        header_length = oip.parse_header_length(headers.get(oip.HEADER_LENGTH), len(body))
        if len(body) >= config.json_offload_bytes:
            # A large body takes milliseconds to parse: off the loop, others keep being served.
            return await asyncio.to_thread(
                oip.parse_infer_request, body, header_length, config.decoded_limit_bytes
            )
        return oip.parse_infer_request(body, header_length, config.decoded_limit_bytes)

    async def infer(request: Request, name: str, version: str | None) -> Response:
        try:
            answer = await run_infer(
                router, config, metrics, "http", name, version,
                lambda: read_infer_body(request), request.headers,
            )  # fmt: skip
        except InferFailure as failure:
            return _error(failure.status, failure.message, failure.headers or None)
        mv, parsed = answer.version, answer.request
        body, header_length = oip.infer_response_body(
            name,
            mv.version,
            parsed.request_id,
            mv.output,
            answer.output,
            binary=parsed.wants_binary(mv.output.name),
        )
        if answer.trace is not None:
            answer.trace.finish("200")
        if header_length is None:
            return Response(body, media_type=JSON)
        return Response(
            body, media_type=OCTET, headers={"Inference-Header-Content-Length": str(header_length)}
        )

    infer_doc: dict[str, Any] = {
        "openapi_extra": {
            "requestBody": {
                "required": True,
                "content": {JSON: {"schema": {"$ref": "#/components/schemas/InferenceRequest"}}},
            }
        },
        "responses": {
            200: {"model": schemas.InferenceResponse},
            400: {"model": schemas.ErrorResponse},
            404: {"model": schemas.ErrorResponse},
            413: {"model": schemas.ErrorResponse},
            429: {"model": schemas.ErrorResponse},
            503: {"model": schemas.ErrorResponse},
            504: {"model": schemas.ErrorResponse},
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
    # `InferRoute`, innermost (appended: inside the limits), which skips the framework's
    # per-request layers.
    app.user_middleware.append(Middleware(InferRoute, handler=infer))

    @app.get("/v2/health/live", response_model=schemas.ServerHealth, tags=["health"])
    async def live() -> dict[str, Any]:
        return {"live": True}

    @app.get(
        "/v2/health/ready",
        response_model=schemas.ServerHealth,
        tags=["health"],
        responses={400: {"model": schemas.ServerHealth}},
    )
    async def ready() -> Response:
        ok = router.ready
        return JSONResponse({"ready": ok}, status_code=200 if ok else 400)

    @app.get("/v2", response_model=schemas.ServerMetadata, tags=["metadata"])
    async def server_metadata() -> dict[str, Any]:
        return {"name": "hpcml", "version": hpcml.__version__, "extensions": EXTENSIONS}

    add_triton_routes(app, router, _error)  # before /v2/models/{name}: "stats" is no name

    def metadata_response(name: str, version: str | None) -> Response:
        try:
            return JSONResponse(model_metadata(router, name, version))
        except NotFound as exc:
            return _error(404, str(exc))

    meta_doc: dict[str, Any] = {
        "response_model": schemas.ModelMetadata,
        "responses": {404: {"model": schemas.ErrorResponse}},
        "tags": ["metadata"],
    }

    @app.get("/v2/models/{name}", **meta_doc)
    async def model_meta(name: str) -> Response:
        return metadata_response(name, None)

    @app.get("/v2/models/{name}/versions/{version}", **meta_doc)
    async def version_meta(name: str, version: str) -> Response:
        return metadata_response(name, version)

    def model_ready(name: str, version: str | None) -> Response:
        try:
            ok = model_is_ready(router, name, version)
        except NotFound as exc:
            return _error(404, str(exc))
        return JSONResponse({"name": name, "ready": ok}, status_code=200 if ok else 400)

    ready_doc: dict[str, Any] = {
        "response_model": schemas.ModelReady,
        "responses": {400: {"model": schemas.ModelReady}, 404: {"model": schemas.ErrorResponse}},
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

    @app.post("/v2/repository/index", tags=["metadata"])
    async def repository_index() -> list[dict[str, Any]]:
        """Every served model version and its state (Triton's repository index; no load/unload)."""
        return [
            {
                "name": mv.model,
                "version": mv.version,
                "state": "READY" if mv.ready else "UNAVAILABLE",
            }
            for mv in router.all_versions()
        ]

    add_admin_routes(app, router, _error)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes
            )
            extra = schemas.InferenceRequest.model_json_schema(
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
    tracer: Any = None,
) -> FastAPI:
    """The app for PATH (see `resolve_model_source`) with `config`; models load at startup.

    `trust_code` (`--trust-code`) lets a model.json that names an import path run that code;
    `follow_poll_s` makes a `models:/NAME@ALIAS` PATH follow its alias (`--follow`); `tracer`
    (an OpenTelemetry tracer) writes a trace per request, as `config.tracing` does through the
    program's tracer provider or OTLP."""
    from hpcml.errors import ConfigError
    from hpcml.serve.runtime.repository import ModelSource, resolve_model_source

    source = (
        resolve_model_source(path, name)
        if path is not None
        else ModelSource("repository", Path("."))
    )
    metrics = ServeMetrics()
    if tracer is None and config.tracing:
        from hpcml.observe.tracing import NO_ENDPOINT, start_tracer

        tracer = start_tracer("hpcml.serve", {"service.name": "hpcml-serve"}, "--tracing")
        if tracer is None:
            import sys

            print(NO_ENDPOINT.format(what="--tracing"), file=sys.stderr, flush=True)
    metrics.tracer = tracer
    router = Router.from_source(source, config, metrics, seed, trust_code=trust_code)
    if not router.models:
        raise ConfigError(
            "nothing to serve: give a model PATH or versions with paths in the serve config."
        )
    if follow_poll_s is not None:
        from hpcml.serve.traffic.follow import follow

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


def http_protocol(config: ServeConfig) -> Any:
    """uvicorn's `http` setting: httptools with a header deadline when one is configured."""
    if config.header_timeout_s is None:
        return "auto"
    from hpcml.serve.protocol.header_timeout import header_timeout_protocol

    return header_timeout_protocol(config.header_timeout_s)


def tls_options(config: ServeConfig) -> dict[str, Any]:
    """uvicorn's TLS settings for `config.tls` (none without it); the files are checked first,
    so a wrong one is a sentence, not a failed startup."""
    if config.tls is None:
        return {}
    import ssl

    from hpcml.observe.tls import server_context

    server_context(config.tls, "--tls-cert/--tls-key/--tls-client-ca")
    options: dict[str, Any] = {"ssl_certfile": config.tls.cert, "ssl_keyfile": config.tls.key}
    if config.tls.client_ca is not None:
        options.update(ssl_ca_certs=config.tls.client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return options


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
            http=http_protocol(config),
            **tls_options(config),
        )
    )
