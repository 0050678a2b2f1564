"""One inference call, whatever the protocol: route, check, wait for the batch, count it.

The REST routes and the gRPC servicer both call `run_infer`, so they share the router, the
batchers, the error mapping and the metrics. Every failure leaves as an `InferFailure` that
carries its HTTP status and its gRPC status code (the gRPC mapping follows Triton's).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hpcml.serve.codec.oip import (
    InferRequest,
    ProtocolError,
    check_inputs,
    check_requested_outputs,
)
from hpcml.serve.config import ServeConfig
from hpcml.serve.metrics import GRPC_CODE_OF_HTTP, ServeMetrics
from hpcml.serve.protocol.spans import RequestTrace
from hpcml.serve.runtime.batcher import (
    BackendFailed,
    BatcherClosed,
    QueueFull,
    RequestTimeout,
    WorkerLost,
)
from hpcml.serve.traffic.router import Router
from hpcml.serve.traffic.versions import ModelVersion, NotFound

log = logging.getLogger(__name__)

# Extensions of the protocol this server implements (Triton's names), and no others. Clients
# read them: Triton's perf_analyzer asks for a model's statistics around its measurement (and
# reports the server's side) only when the server announces `statistics`.
EXTENSIONS = ["binary_tensor_data", "model_configuration", "statistics"]

@dataclass
class InferFailure(Exception):
    status: int
    message: str
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def grpc_code(self) -> str:
        return GRPC_CODE_OF_HTTP.get(self.status, "UNKNOWN")


@dataclass
class InferAnswer:
    version: ModelVersion
    request: InferRequest
    output: np.ndarray
    trace: RequestTrace | None = None
    """With tracing on: call `trace.finish(code)` once the answer is encoded."""


def failure_of(
    exc: BaseException, name: str, chosen: ModelVersion | None, config: ServeConfig
) -> InferFailure:
    """The protocol-neutral failure for an exception raised while answering a request."""
    if isinstance(exc, ProtocolError):
        return InferFailure(exc.status, exc.message)
    if isinstance(exc, NotFound):
        return InferFailure(404, str(exc))
    if isinstance(exc, QueueFull):
        assert chosen is not None
        b = chosen.batcher
        msg = (
            f"model '{chosen.model}' version {chosen.version} is overloaded: its queue holds "
            f"{b.queue_depth} samples (limit {b.max_queue_size}); retry later."
        )
        status = config.overload_status
        return InferFailure(status, msg, {"Retry-After": str(config.retry_after_s)})
    if isinstance(exc, RequestTimeout):
        timeout = chosen.config.timeout_ms if chosen is not None else 0.0
        return InferFailure(504, f"request to model '{name}' timed out after {timeout:g} ms.")
    if isinstance(exc, BatcherClosed):
        return InferFailure(
            503,
            "the server is shutting down; retry on another replica.",
            {"Retry-After": str(config.retry_after_s)},
        )
    if isinstance(exc, WorkerLost):
        return InferFailure(
            503,
            f"the inference process of model '{name}' died and is being restarted; retry.",
            {"Retry-After": str(config.retry_after_s)},
        )
    if isinstance(exc, BackendFailed):
        return InferFailure(500, f"model '{name}' failed to compute the batch: {exc}")
    # A bug of ours, not the client's: logged with its traceback here, one line to the client.
    log.error("unexpected error answering a request for model %r", name, exc_info=exc)
    return InferFailure(500, f"internal error ({type(exc).__name__}); see the server log.")


async def run_infer(
    router: Router,
    config: ServeConfig,
    metrics: ServeMetrics,
    protocol: str,
    name: str,
    version: str | None,
    read_request: Callable[[], Awaitable[InferRequest]],
    carrier: Any = None,
) -> InferAnswer:
    """Answer one request for model `name` (a version, or the router's pick) or raise InferFailure.

    `read_request` parses the body; it runs after the model and version are known to exist, so
    an unknown model is a 404 whatever the body holds. `carrier`: the request's headers or gRPC
    metadata as a mapping of lower-case names, where a W3C `traceparent` continues the client's
    trace (read only with tracing on).
    """
    started = time.perf_counter()
    tracer = getattr(metrics, "tracer", None)
    rt = RequestTrace(tracer, protocol, name, version, carrier) if tracer is not None else None
    chosen: ModelVersion | None = None
    # Unknown names must not create metric series (any client could invent them).
    label_model = name if name in router.models else ""
    label_version = version or ""
    code = "500" if protocol == "http" else "INTERNAL"
    try:
        model = router.model(name)
        if version is not None:
            model.version(version)
        parsed = await read_request()
        if rt is not None:
            rt.parsed()

        def prepare(mv: ModelVersion) -> np.ndarray:
            nonlocal chosen
            chosen = mv
            x = check_inputs(parsed, mv.input, mv.config.max_batch_size, name)
            check_requested_outputs(parsed, [mv.output], name)
            return x

        mv, result = await router.infer(name, version, prepare)
        mv.stats.succeeded(
            time.perf_counter() - started, result.queue_s, result.compute_s, len(result.output)
        )
        code = "200" if protocol == "http" else "OK"
        if rt is not None:
            rt.computed(result, mv.version)
        return InferAnswer(mv, parsed, result.output, rt)
    except asyncio.CancelledError:
        code = "499" if protocol == "http" else "CANCELLED"  # the client went away
        if rt is not None:
            rt.finish(code, "the client went away")
        raise
    except Exception as exc:
        failure = failure_of(exc, name, chosen, config)
        if chosen is not None:
            chosen.stats.failed(time.perf_counter() - started, server_error=failure.status >= 500)
        code = str(failure.status) if protocol == "http" else failure.grpc_code
        if rt is not None:
            rt.finish(code, failure.message)
        raise failure from None
    finally:
        if chosen is not None:
            label_version = chosen.version
        elif label_version and (
            label_model == "" or label_version not in router.models[name].versions
        ):
            label_version = ""
        if chosen is not None:
            metrics.request_duration.labels(label_model, label_version, protocol).observe(
                time.perf_counter() - started
            )
        metrics.requests.labels(label_model, label_version, protocol, code).inc()


def model_is_ready(router: Router, name: str, version: str | None) -> bool:
    """A version's readiness, or for a model whether every version taking traffic is ready."""
    model = router.model(name)
    also = router.also_ready.get(name)
    if also is not None and not also():
        return False
    if version:
        return model.version(version).ready
    return all(model.versions[v].ready for v in model.policy.weights)


def model_metadata(router: Router, name: str, version: str | None) -> dict[str, Any]:
    """Model metadata (inputs, outputs, platform); all versions when none is named."""
    from hpcml.serve.runtime.repository import sorted_versions

    model = router.model(name)
    meta = model.version(version).metadata()
    if version is None:
        meta["versions"] = sorted_versions(list(model.versions))
    return meta
