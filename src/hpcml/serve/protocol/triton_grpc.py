"""Triton's gRPC model-configuration, statistics and repository-index calls.

Triton's `grpc_service.proto` extends KServe's `inference.GRPCInferenceService` with
ModelConfig, ModelStatistics and RepositoryIndex. Their messages are declared here, in code,
with Triton's field numbers and only the fields this server fills (the wire format depends on
numbers and types alone, so tritonclient reads them with its full messages), in a private
descriptor pool beside `oip_pb`'s. The answers are the JSON forms of `triton_config` parsed into
these messages, so REST and gRPC cannot disagree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, json_format, message_factory

from hpcml.serve.protocol.triton_config import model_config, model_statistics
from hpcml.serve.traffic.router import Router
from hpcml.serve.traffic.versions import NotFound

SERVICE = "inference.GRPCInferenceService"
_F = descriptor_pb2.FieldDescriptorProto
_STRING, _BOOL, _INT32, _INT64, _UINT64 = (
    _F.TYPE_STRING, _F.TYPE_BOOL, _F.TYPE_INT32, _F.TYPE_INT64, _F.TYPE_UINT64,
)  # fmt: skip
_MESSAGE, _ENUM = _F.TYPE_MESSAGE, _F.TYPE_ENUM
_DATA_TYPES = ["TYPE_INVALID", "TYPE_BOOL", "TYPE_UINT8", "TYPE_UINT16", "TYPE_UINT32",
               "TYPE_UINT64", "TYPE_INT8", "TYPE_INT16", "TYPE_INT32", "TYPE_INT64", "TYPE_FP16",
               "TYPE_FP32", "TYPE_FP64", "TYPE_STRING", "TYPE_BF16"]  # fmt: skip
_DURATION = ("inference.StatisticDuration", _MESSAGE)
# Message -> [(field, number, type or (type name, kind), repeated)], Triton's numbering.
_MESSAGES: dict[str, list[tuple[str, int, Any, bool]]] = {
    "ModelConfigRequest": [("name", 1, _STRING, False), ("version", 2, _STRING, False)],
    "ModelInput": [("name", 1, _STRING, False), ("data_type", 2, ("inference.DataType", _ENUM), False),
                   ("dims", 4, _INT64, True)],
    "ModelOutput": [("name", 1, _STRING, False), ("data_type", 2, ("inference.DataType", _ENUM), False),
                    ("dims", 3, _INT64, True)],
    "ModelDynamicBatching": [("preferred_batch_size", 1, _INT32, True),
                             ("max_queue_delay_microseconds", 2, _UINT64, False)],
    "ModelInstanceGroup": [("name", 1, _STRING, False), ("count", 2, _INT32, False),
                           ("kind", 4, ("inference.ModelInstanceGroup.Kind", _ENUM), False)],
    "ModelConfig": [("name", 1, _STRING, False), ("platform", 2, _STRING, False),
                    ("max_batch_size", 4, _INT32, False),
                    ("input", 5, ("inference.ModelInput", _MESSAGE), True),
                    ("output", 6, ("inference.ModelOutput", _MESSAGE), True),
                    ("instance_group", 7, ("inference.ModelInstanceGroup", _MESSAGE), True),
                    ("dynamic_batching", 11, ("inference.ModelDynamicBatching", _MESSAGE), False),
                    ("backend", 17, _STRING, False)],
    "ModelConfigResponse": [("config", 1, ("inference.ModelConfig", _MESSAGE), False)],
    "RepositoryIndexRequest": [("repository_name", 1, _STRING, False), ("ready", 2, _BOOL, False)],
    "RepositoryIndexResponse": [
        ("models", 1, ("inference.RepositoryIndexResponse.ModelIndex", _MESSAGE), True)],
    "ModelIndex": [("name", 1, _STRING, False), ("version", 2, _STRING, False),
                   ("state", 3, _STRING, False), ("reason", 4, _STRING, False)],
    "ModelStatisticsRequest": [("name", 1, _STRING, False), ("version", 2, _STRING, False)],
    "StatisticDuration": [("count", 1, _UINT64, False), ("ns", 2, _UINT64, False)],
    "InferStatistics": [(name, i + 1, _DURATION, False) for i, name in enumerate(
        ["success", "fail", "queue", "compute_input", "compute_infer", "compute_output",
         "cache_hit", "cache_miss"])],
    "InferBatchStatistics": [("batch_size", 1, _UINT64, False), ("compute_input", 2, _DURATION, False),
                             ("compute_infer", 3, _DURATION, False),
                             ("compute_output", 4, _DURATION, False)],
    "ModelStatistics": [("name", 1, _STRING, False), ("version", 2, _STRING, False),
                        ("last_inference", 3, _UINT64, False), ("inference_count", 4, _UINT64, False),
                        ("execution_count", 5, _UINT64, False),
                        ("inference_stats", 6, ("inference.InferStatistics", _MESSAGE), False),
                        ("batch_stats", 7, ("inference.InferBatchStatistics", _MESSAGE), True)],
    "ModelStatisticsResponse": [("model_stats", 1, ("inference.ModelStatistics", _MESSAGE), True)],
}  # fmt: skip
_NESTED = {"ModelIndex": "RepositoryIndexResponse"}


def _add_fields(proto: Any, fields: list[tuple[str, int, Any, bool]]) -> None:
    for name, number, kind, repeated in fields:
        label = _F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL
        if isinstance(kind, tuple):
            proto.field.add(
                name=name, number=number, type=kind[1], type_name="." + kind[0], label=label
            )
        else:
            proto.field.add(name=name, number=number, type=kind, label=label)


def _build_pool() -> descriptor_pool.DescriptorPool:
    file = descriptor_pb2.FileDescriptorProto(
        name="hpcml/serve/triton_grpc.proto", package="inference", syntax="proto3"
    )
    enum = file.enum_type.add(name="DataType")
    for number, name in enumerate(_DATA_TYPES):
        enum.value.add(name=name, number=number)
    protos: dict[str, Any] = {}
    for name, fields in _MESSAGES.items():
        parent = _NESTED.get(name)
        container = protos[parent].nested_type if parent else file.message_type
        protos[name] = container.add(name=name)
        _add_fields(protos[name], fields)
    kind = protos["ModelInstanceGroup"].enum_type.add(name="Kind")
    for number, name in enumerate(["KIND_AUTO", "KIND_GPU", "KIND_CPU", "KIND_MODEL"]):
        kind.value.add(name=name, number=number)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return pool


_POOL = _build_pool()


def message(name: str) -> Any:
    """The message class of `inference.<name>` (nested names with a dot)."""
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"inference.{name}"))


def _versions(router: Router, name: str, version: str) -> list[Any]:
    if not name:
        return router.all_versions()
    model = router.model(name)
    return [model.version(version)] if version else list(model.versions.values())


def triton_handlers(router: Router) -> dict[str, Any]:
    """Method name -> unary handler, for `grpc.method_handlers_generic_handler(SERVICE, ...)`."""
    config_response, stats_response = (
        message("ModelConfigResponse"),
        message("ModelStatisticsResponse"),
    )
    index_response = message("RepositoryIndexResponse")

    async def model_config_call(request: Any, context: Any) -> Any:
        try:
            model = router.model(request.name)
            mv = model.version(request.version) if request.version else model.newest
        except NotFound as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        config = json_format.ParseDict(
            model_config(mv), message("ModelConfig")(), ignore_unknown_fields=True
        )
        return config_response(config=config)

    async def model_statistics_call(request: Any, context: Any) -> Any:
        try:
            versions = _versions(router, request.name, request.version)
        except NotFound as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        body = {"model_stats": [model_statistics(mv) for mv in versions]}
        return json_format.ParseDict(body, stats_response(), ignore_unknown_fields=True)

    async def repository_index_call(request: Any, context: Any) -> Any:
        index = message("RepositoryIndexResponse.ModelIndex")
        models = [
            index(name=mv.model, version=mv.version, state="READY" if mv.ready else "UNAVAILABLE")
            for mv in router.all_versions()
            if mv.ready or not request.ready
        ]
        return index_response(models=models)

    calls: dict[str, tuple[Callable[..., Any], str]] = {
        "ModelConfig": (model_config_call, "ModelConfigRequest"),
        "ModelStatistics": (model_statistics_call, "ModelStatisticsRequest"),
        "RepositoryIndex": (repository_index_call, "RepositoryIndexRequest"),
    }
    return {
        method: grpc.unary_unary_rpc_method_handler(
            call,
            request_deserializer=message(request).FromString,
            response_serializer=lambda m: m.SerializeToString(),
        )
        for method, (call, request) in calls.items()
    }
