"""The Open Inference Protocol v2 over gRPC: `inference.GRPCInferenceService` with grpcio.

Serves ServerLive, ServerReady, ModelReady, ServerMetadata, ModelMetadata and ModelInfer of
KServe's `grpc_predict_v2.proto` (stubs in `oip_pb`), which Triton's `grpc_service.proto`
extends with the same messages, so tritonclient's and KServe's gRPC clients both work; and
Triton's ModelConfig, ModelStatistics and RepositoryIndex (`triton_grpc`). The
server is a `grpc.aio` server on the HTTP server's event loop, started by the app's lifespan:
requests go through the same router, batchers, errors and metrics as REST (`inference`).
Inputs arrive as `raw_input_contents` (what stock clients send) or typed `contents`; outputs
always leave as `raw_output_contents`, as Triton answers.

Beside it runs the standard `grpc.health.v1.Health` service (grpcio-health-checking): the
service "" is SERVING while every model is ready, each model name while its versions taking
traffic are; Watch streams the changes. Only ModelInfer counts against `limit_concurrency`, so
probes answer while inference is saturated; refusals a retry may cure carry Retry-After's
gRPC form, `grpc-retry-pushback-ms` trailing metadata.

With `tls` the port speaks TLS only (mutual TLS with a client CA). Every method but the health
service asks the token gate first (`check_caller`, `authorization: Bearer <token>` metadata):
UNAUTHENTICATED, PERMISSION_DENIED or RESOURCE_EXHAUSTED in the same sentences as HTTP's
401, 403 and 429.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import numpy as np
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

import hpcml
from hpcml.errors import ConfigError
from hpcml.serve.codec.oip import InferRequest
from hpcml.serve.codec.tensors import (
    DATATYPES,
    DecodeBudget,
    ProtocolError,
    check_finite,
    check_shape,
    datatype_of_array,
    dtype_of,
    element_count,
    from_raw,
    to_raw,
)
from hpcml.serve.config import ServeConfig
from hpcml.serve.metrics import ServeMetrics
from hpcml.serve.oip_pb import grpc_predict_v2_pb2 as pb
from hpcml.serve.oip_pb import grpc_predict_v2_pb2_grpc as pb_grpc
from hpcml.serve.protocol.inference import (
    EXTENSIONS,
    InferFailure,
    model_is_ready,
    model_metadata,
    run_infer,
)
from hpcml.serve.protocol.triton_grpc import SERVICE, triton_handlers
from hpcml.serve.tokens import GRPC_NEEDS, Authorizer, Need, Refusal, bearer
from hpcml.serve.traffic.router import Router
from hpcml.serve.traffic.versions import NotFound

# How often readiness is read for the health service: the longest a Watch lags a change.
HEALTH_POLL_S = 0.2
# Typed `contents` field of each datatype (FP16 has none: it must be sent raw).
_CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


def _from_contents(contents: Any, datatype: str, shape: tuple[int, ...], where: str) -> np.ndarray:
    field = _CONTENTS_FIELD.get(datatype)
    if field is None:
        raise ProtocolError(f"{where} is {datatype}, which must be sent in raw_input_contents.")
    values = getattr(contents, field)
    expected = element_count(shape)
    if len(values) != expected:
        raise ProtocolError(
            f"{where} has {len(values)} values in contents.{field} but shape {list(shape)} "
            f"needs {expected}."
        )
    dtype = DATATYPES[datatype]
    if dtype.kind == "O":
        array = np.empty(expected, dtype=object)
        array[:] = list(values)
    elif dtype.kind in "iu" and dtype.itemsize < 4:
        wide = np.array(values, dtype=np.int64)
        info = np.iinfo(dtype)
        if wide.size and (wide.min() < info.min or wide.max() > info.max):
            raise ProtocolError(f"{where} holds values outside the range of {datatype}.")
        array = wide.astype(dtype)
    else:
        array = check_finite(np.array(values, dtype=dtype), datatype, where)
    return array.reshape(shape)


def _param(value: Any) -> Any:
    return getattr(value, value.WhichOneof("parameter_choice") or "string_param")


def request_from_grpc(msg: Any, max_decoded_bytes: int | None = None) -> InferRequest:
    """An `InferRequest` from a ModelInferRequest; client mistakes raise ProtocolError.

    `max_decoded_bytes` bounds the decoded size of all inputs, as in `parse_infer_request`."""
    if not msg.inputs:
        raise ProtocolError("request has no inputs; send at least one input tensor.")
    raw = msg.raw_input_contents
    if raw and len(raw) != len(msg.inputs):
        raise ProtocolError(
            f"raw_input_contents has {len(raw)} entries for {len(msg.inputs)} inputs; send one "
            "per input, in input order."
        )
    params = {k: _param(v) for k, v in msg.parameters.items()}
    if "classification" in params:
        raise ProtocolError("the classification extension is not supported; omit 'classification'.")
    request = InferRequest({}, msg.id or None, None, params)
    budget = DecodeBudget(max_decoded_bytes)
    for i, tensor in enumerate(msg.inputs):
        if not tensor.name:
            raise ProtocolError(f"input #{i} has no name; every input tensor needs one.")
        where = f"input '{tensor.name[:64]}'"
        if tensor.name in request.inputs:
            raise ProtocolError(f"{where} appears twice; send each input once.")
        shape = check_shape(list(tensor.shape), where)
        dtype_of(tensor.datatype, where)
        budget.charge(shape, tensor.datatype, where)
        if raw:
            if tensor.HasField("contents"):
                raise ProtocolError(f"{where} has contents and raw_input_contents; send one.")
            array = from_raw(raw[i], tensor.datatype, shape, where)
        else:
            array = _from_contents(tensor.contents, tensor.datatype, shape, where)
        request.inputs[tensor.name] = array
        request.datatypes[tensor.name] = tensor.datatype
    if msg.outputs:
        request.requested_outputs = [o.name for o in msg.outputs]
    return request


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, router: Router, config: ServeConfig, metrics: ServeMetrics) -> None:
        self.router = router
        self.config = config
        self.metrics = metrics
        self.in_flight = 0

    def _pushback(self) -> tuple[tuple[str, str], ...]:
        return (("grpc-retry-pushback-ms", str(self.config.retry_after_s * 1000)),)

    async def ServerLive(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC names
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: Any) -> Any:  # noqa: N802
        return pb.ServerReadyResponse(ready=self.router.ready)

    async def ModelReady(self, request: Any, context: Any) -> Any:  # noqa: N802
        try:
            ready = model_is_ready(self.router, request.name, request.version or None)
        except NotFound as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        return pb.ModelReadyResponse(ready=ready)

    async def ServerMetadata(self, request: Any, context: Any) -> Any:  # noqa: N802
        return pb.ServerMetadataResponse(
            name="hpcml", version=hpcml.__version__, extensions=EXTENSIONS
        )

    async def ModelMetadata(self, request: Any, context: Any) -> Any:  # noqa: N802
        try:
            meta = model_metadata(self.router, request.name, request.version or None)
        except NotFound as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=meta["name"],
            versions=meta["versions"],
            platform=meta["platform"],
            inputs=[tensor(**t) for t in meta["inputs"]],
            outputs=[tensor(**t) for t in meta["outputs"]],
        )

    async def ModelInfer(self, request: Any, context: Any) -> Any:  # noqa: N802
        async def read() -> InferRequest:
            return request_from_grpc(request, self.config.decoded_limit_bytes)

        limit = self.config.limit_concurrency
        if limit is not None and self.in_flight >= limit:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the server is handling its limit of {limit} concurrent requests; retry later.",
                trailing_metadata=self._pushback(),
            )
        self.in_flight += 1
        try:
            answer = await run_infer(
                self.router,
                self.config,
                self.metrics,
                "grpc",
                request.model_name,
                request.model_version or None,
                read,
                _metadata(context) if self.metrics.tracer is not None else None,
            )
        except InferFailure as failure:
            retry = self._pushback() if "Retry-After" in failure.headers else ()
            await context.abort(
                grpc.StatusCode[failure.grpc_code], failure.message, trailing_metadata=retry
            )
        finally:
            self.in_flight -= 1
        out = answer.output
        mv = answer.version
        response = pb.ModelInferResponse(
            model_name=request.model_name,
            model_version=mv.version,
            id=request.id,
            outputs=[
                pb.ModelInferResponse.InferOutputTensor(
                    name=mv.output.name, datatype=datatype_of_array(out), shape=list(out.shape)
                )
            ],
            raw_output_contents=[to_raw(out)],
        )
        if answer.trace is not None:
            answer.trace.finish("OK")
        return response


class _Malformed:
    """What a request that is not its message type's protobuf decodes to."""


_MALFORMED = _Malformed()


_REFUSAL_CODES = {
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


async def check_caller(
    authorizer: Authorizer,
    method: str,
    request: Any,
    context: Any,
    on_refused: Callable[[str, str | None, str], None],
) -> None:
    """The token gate of gRPC: `authorization: Bearer <token>` metadata, the role the method
    needs and the model the request names; a refusal (`on_refused(method, model, code)`)
    aborts the call in one sentence."""
    token = bearer(_metadata(context).get("authorization"))
    model = getattr(request, "model_name", None) or getattr(request, "name", None) or None
    need: Need = GRPC_NEEDS.get(method, "read")
    try:
        authorizer.check(token, need, model, f"call {method}")
    except Refusal as refusal:
        code = _REFUSAL_CODES[refusal.status]
        on_refused(method, model, code.name)
        pushback: tuple[tuple[str, str], ...] = ()
        if refusal.retry_after_s is not None:
            pushback = (("grpc-retry-pushback-ms", str(int(refusal.retry_after_s * 1000))),)
        await context.abort(code, refusal.message, trailing_metadata=pushback)


class _CheckedRegistrar:
    """Stands in for the server while the generated code registers the service: each method's
    handler gets a deserializer that cannot raise and a behavior that answers a malformed
    message INVALID_ARGUMENT (grpcio alone answers INTERNAL/UNKNOWN with a Python class name),
    and asks the token gate (`check_caller`) before it runs."""

    def __init__(
        self, server: Any, on_malformed: Any, gate: Callable[[str, Any, Any], Awaitable[None]]
    ) -> None:
        self.server, self.on_malformed, self.gate = server, on_malformed, gate

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass  # the same handlers arrive, checked, through add_registered_method_handlers

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        checked = self.add_generic(service, handlers)
        self.server.add_registered_method_handlers(service, checked)

    def add_generic(self, service: str, handlers: dict[str, Any]) -> dict[str, Any]:
        checked = {name: self._checked(name, h) for name, h in handlers.items()}
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, checked),)
        )
        return checked

    def _checked(self, method: str, handler: Any) -> Any:
        decode, behavior = handler.request_deserializer, handler.unary_unary

        def deserialize(data: bytes) -> Any:
            try:
                return decode(data)
            except DecodeError:
                return _MALFORMED

        async def answer(request: Any, context: Any) -> Any:
            if request is _MALFORMED:
                self.on_malformed(method)
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"the {method} request is not a valid protobuf message of its type "
                    "(inference.GRPCInferenceService); send one built from the service's proto.",
                )
            await self.gate(method, request, context)
            return await behavior(request, context)

        return handler._replace(request_deserializer=deserialize, unary_unary=answer)


def _health_statuses(router: Router) -> dict[str, Any]:
    serving = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    statuses = {
        name: serving if model_is_ready(router, name, None) else not_serving
        for name in router.models
    }
    statuses[""] = serving if router.ready else not_serving
    return statuses


class HealthServicer(health.aio.HealthServicer):  # type: ignore[misc]
    """grpc.health.v1.Health whose statuses follow the router's readiness: read at each Check,
    and every HEALTH_POLL_S for Watch streams."""

    def __init__(self, router: Router) -> None:
        super().__init__()
        self.router = router
        self.known: dict[str, Any] = {}

    async def refresh(self) -> None:
        for service, status in _health_statuses(self.router).items():
            if self.known.get(service) != status:
                await self.set(service, status)
                self.known[service] = status

    async def Check(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC names
        await self.refresh()
        return await super().Check(request, context)

    async def follow(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(HEALTH_POLL_S)


class GrpcEndpoint:
    """The running gRPC server and the task that keeps its health service current."""

    def __init__(self, server: Any, servicer: HealthServicer, follower: asyncio.Task[None]) -> None:
        self.server, self.health, self.follower = server, servicer, follower

    async def stop(self, grace_s: float) -> None:
        self.follower.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.follower
        await self.health.enter_graceful_shutdown()  # Watchers see NOT_SERVING
        await self.server.stop(grace_s)


def _credentials(config: ServeConfig) -> Any:
    """TLS credentials for `config.tls` (mutual TLS with a client CA), or None."""
    tls = config.tls
    if tls is None:
        return None
    from hpcml.observe.tls import read_pem

    where = "--tls-cert/--tls-key/--tls-client-ca"
    pair = (read_pem(tls.key, where), read_pem(tls.cert, where))
    ca = read_pem(tls.client_ca, where) if tls.client_ca else None
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=bool(ca))


async def start_grpc_server(
    router: Router, config: ServeConfig, metrics: ServeMetrics, authorizer: Authorizer
) -> tuple[GrpcEndpoint, int]:
    """Start the gRPC endpoint on `config.host:config.grpc_port`; returns it and its port.
    `authorizer` (`app.authorizer_of`): who may call what."""
    assert config.grpc_port is not None
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", config.max_body_bytes),
            ("grpc.max_send_message_length", -1),
            ("grpc.so_reuseport", 0),
        ],
    )

    def malformed(method: str) -> None:
        if method == "ModelInfer":  # counted like every other inference answer
            metrics.requests.labels("", "", "grpc", "INVALID_ARGUMENT").inc()

    def refused(method: str, model: str | None, code: str) -> None:
        if method == "ModelInfer":  # counted like every other inference answer
            known = model if model in router.models else ""
            metrics.requests.labels(known, "", "grpc", code).inc()

    async def gate(method: str, request: Any, context: Any) -> None:
        if authorizer.tokens_file:  # without one, no gRPC method asks for a token
            await check_caller(authorizer, method, request, context, refused)

    registrar = _CheckedRegistrar(server, malformed, gate)
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(
        InferenceServicer(router, config, metrics), registrar
    )
    # Triton's extension methods of the same service (model config, statistics, index).
    registrar.add_generic(SERVICE, triton_handlers(router))
    health_servicer = HealthServicer(router)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    host = f"[{config.host}]" if ":" in config.host else config.host
    credentials = _credentials(config)
    address = f"{host}:{config.grpc_port}"
    try:
        if credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, credentials)
    except RuntimeError:
        port = 0
    if port == 0:
        raise ConfigError(
            f"cannot listen for gRPC on {config.host}:{config.grpc_port} (in use, or not an "
            "address of this machine); pick another --grpc-port."
        )
    await server.start()
    await health_servicer.refresh()
    follower = asyncio.get_running_loop().create_task(health_servicer.follow())
    return GrpcEndpoint(server, health_servicer, follower), port


def _metadata(context: Any) -> dict[str, str]:
    """The call's invocation metadata (gRPC keys are lower case), where `traceparent` travels."""
    return {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
