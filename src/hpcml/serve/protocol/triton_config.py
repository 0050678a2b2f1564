"""Triton's model configuration and statistics extensions, read from what the server holds.

`GET /v2/models/{m}[/versions/{v}]/config` answers a model's configuration in Triton's JSON form
(`max_batch_size`, inputs and outputs with `TYPE_*` datatypes and per-sample `dims`, dynamic
batching, instance count), and `GET /v2/models[/{m}[/versions/{v}]]/stats` its statistics
(`inference_stats` success / fail / queue / compute, and `batch_stats` per batch size), so
tritonclient's `get_model_config` and `get_inference_statistics` work unchanged (over gRPC
too: `triton_grpc` parses these same dictionaries into Triton's messages). Counts and
nanosecond totals are kept per version by `InferStats`, which `inference.run_infer` updates
as requests end, and per batch size by the batcher's `BatchingStats`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

# At run time: FastAPI reads the routes' annotations from this module's globals.
from fastapi.responses import JSONResponse, Response

from hpcml.serve.runtime.repository import sorted_versions
from hpcml.serve.traffic.router import Router
from hpcml.serve.traffic.versions import ModelVersion, NotFound

if TYPE_CHECKING:
    from fastapi import FastAPI

# Triton's model-config datatype names for the protocol's.
_CONFIG_TYPE = {"BYTES": "TYPE_STRING"}


def _tensor_config(spec: Any) -> dict[str, Any]:
    datatype = _CONFIG_TYPE.get(spec.datatype, f"TYPE_{spec.datatype}")
    return {"name": spec.name, "data_type": datatype, "dims": list(spec.shape)}


def model_config(mv: ModelVersion) -> dict[str, Any]:
    """Triton's JSON model configuration of a served version."""
    cfg = mv.config
    instances = len(mv.batcher.instances)
    kind = "KIND_GPU" if cfg.device == "cuda" else "KIND_CPU"
    return {
        "name": mv.model,
        "platform": mv.platform,
        "backend": mv.backend_name,
        "max_batch_size": cfg.max_batch_size,
        "input": [_tensor_config(mv.input)],
        "output": [_tensor_config(mv.output)],
        "dynamic_batching": {
            "preferred_batch_size": list(cfg.preferred_batch_sizes),
            "max_queue_delay_microseconds": int(cfg.max_queue_delay_ms * 1000),
            "default_queue_policy": {
                "timeout_action": "REJECT",
                "default_timeout_microseconds": int(cfg.timeout_ms * 1000),
                "max_queue_size": cfg.max_queue_size,
            },
        },
        "instance_group": [{"name": mv.model, "kind": kind, "count": instances}],
    }


def _duration(count: int, ns: int) -> dict[str, int]:
    return {"count": count, "ns": ns}


def model_statistics(mv: ModelVersion) -> dict[str, Any]:
    """Triton's statistics entry of a served version."""
    s, batching = mv.stats, mv.batcher.stats
    return {
        "name": mv.model,
        "version": mv.version,
        "last_inference": s.last_inference_ms,
        "inference_count": s.inference_count,
        "execution_count": batching.batches,
        "inference_stats": {
            "success": _duration(s.success_count, s.success_ns),
            "fail": _duration(s.fail_count, s.fail_ns),
            "queue": _duration(s.success_count, s.queue_ns),
            "compute_input": _duration(s.success_count, 0),
            "compute_infer": _duration(s.success_count, s.compute_ns),
            "compute_output": _duration(s.success_count, 0),
            "cache_hit": _duration(0, 0),
            "cache_miss": _duration(0, 0),
        },
        "batch_stats": [
            {
                "batch_size": size,
                "compute_input": _duration(n, 0),
                "compute_infer": _duration(n, batching.compute_ns.get(size, 0)),
                "compute_output": _duration(n, 0),
            }
            for size, n in sorted(batching.sizes.items())
        ],
    }


def add_triton_routes(app: FastAPI, router: Router, error: Callable[[int, str], Response]) -> None:
    """The REST routes of both extensions; `error(status, message)` answers a failure."""

    def versions_of(name: str | None, version: str | None) -> list[Any]:
        if name is None:
            return router.all_versions()
        model = router.model(name)
        if version is not None:
            return [model.version(version)]
        return [model.versions[v] for v in sorted_versions(list(model.versions))]

    @app.get("/v2/models/{name}/config", tags=["metadata"])
    @app.get("/v2/models/{name}/versions/{version}/config", tags=["metadata"])
    async def model_config_route(name: str, version: str | None = None) -> Response:
        """Triton's model configuration of the version named, or the newest."""
        try:
            model = router.model(name)
            mv = model.version(version) if version is not None else model.newest
        except NotFound as exc:
            return error(404, str(exc))
        return JSONResponse(model_config(mv))

    # Before /v2/models/{name}, which would take "stats" for a model's name.
    @app.get("/v2/models/stats", tags=["metrics"])
    @app.get("/v2/models/{name}/stats", tags=["metrics"])
    @app.get("/v2/models/{name}/versions/{version}/stats", tags=["metrics"])
    async def model_stats_route(name: str | None = None, version: str | None = None) -> Response:
        """Triton's inference statistics: every version served, a model's, or one version's."""
        try:
            versions = versions_of(name, version)
        except NotFound as exc:
            return error(404, str(exc))
        return JSONResponse({"model_stats": [model_statistics(mv) for mv in versions]})
