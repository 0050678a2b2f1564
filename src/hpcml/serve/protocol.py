"""Open Inference Protocol v2 (KServe / Triton) JSON tensors: parse, check and answer.

Requests are parsed with orjson (4x faster than the stdlib on long float arrays, which is most
of a request's cost on CPU) and turned into one numpy array per input;
every problem a client can cause becomes a `ProtocolError` whose message is sent back as
`{"error": "..."}` with HTTP 400. Pydantic models here only document the API (OpenAPI).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import BaseModel, Field

try:
    import orjson

    def _loads(body: bytes) -> Any:
        return orjson.loads(body)

    def _dumps(obj: Any) -> bytes:
        return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY)

    _DECODE_ERRORS: tuple[type[Exception], ...] = (orjson.JSONDecodeError,)
except ImportError:  # pragma: no cover - orjson is in the serve extra

    def _loads(body: bytes) -> Any:
        return json.loads(body)

    def _dumps(obj: Any) -> bytes:
        return json.dumps(obj, separators=(",", ":"), default=lambda a: a.tolist()).encode()

    _DECODE_ERRORS = (json.JSONDecodeError, UnicodeDecodeError)

# The protocol's tensor datatypes and the numpy dtype each one maps to.
DATATYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(np.object_),
}
_NUMPY_TO_DATATYPE = {v: k for k, v in DATATYPES.items() if k != "BYTES"}
_TORCH_NAME_TO_DATATYPE = {
    "bool": "BOOL",
    "uint8": "UINT8",
    "int8": "INT8",
    "int16": "INT16",
    "int32": "INT32",
    "int64": "INT64",
    "float16": "FP16",
    "float32": "FP32",
    "float64": "FP64",
}


class ProtocolError(Exception):
    """A request the protocol or the model's signature does not allow (HTTP 400)."""

    status = 400

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


def datatype_of(dtype_name: str) -> str:
    """Protocol datatype for a dtype name as written in model.json (`float32` -> `FP32`)."""
    dt = _TORCH_NAME_TO_DATATYPE.get(dtype_name)
    if dt is None:
        raise ValueError(f"dtype {dtype_name!r} has no Open Inference Protocol datatype")
    return dt


def datatype_of_array(a: np.ndarray) -> str:
    return _NUMPY_TO_DATATYPE.get(a.dtype, "BYTES")


@dataclass(frozen=True)
class TensorSpec:
    """One named tensor of a model signature; `shape` is per sample (batch axis implicit)."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    def metadata(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": [-1, *self.shape]}


@dataclass
class InferRequest:
    inputs: dict[str, np.ndarray]
    request_id: str | None
    requested_outputs: list[str] | None
    parameters: dict[str, Any]


def _check_shape(raw: Any, where: str) -> tuple[int, ...]:
    if not isinstance(raw, list) or not all(isinstance(d, int) and d >= 0 for d in raw):
        raise ProtocolError(
            f"{where} 'shape' must be a list of non-negative integers, got {raw!r}."
        )
    return tuple(raw)


def _tensor_from_json(obj: Any, index: int) -> tuple[str, np.ndarray]:
    where = f"input #{index}"
    if not isinstance(obj, dict):
        raise ProtocolError(f"{where} must be an object with name, shape, datatype and data.")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise ProtocolError(f"{where} has no 'name'; every input tensor needs one.")
    where = f"input '{name}'"
    for key in ("shape", "datatype", "data"):
        if key not in obj:
            raise ProtocolError(f"{where} has no '{key}'; inputs need name, shape, datatype, data.")
    shape = _check_shape(obj["shape"], where)
    datatype = obj["datatype"]
    dtype = DATATYPES.get(datatype) if isinstance(datatype, str) else None
    if dtype is None:
        raise ProtocolError(
            f"{where} has datatype {datatype!r}, which the protocol does not define; "
            f"use one of {', '.join(DATATYPES)}."
        )
    data = obj["data"]
    if not isinstance(data, list):
        raise ProtocolError(f"{where} 'data' must be a JSON array (flat or nested, row-major).")
    try:
        array = np.asarray(data, dtype=dtype)
    except (ValueError, TypeError, OverflowError):
        raise ProtocolError(
            f"{where} 'data' cannot be read as {datatype}; send a flat or rectangular nested "
            "array of numbers."
        ) from None
    expected = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if array.size != expected:
        raise ProtocolError(
            f"{where} has {array.size} values in 'data' but shape {list(shape)} needs {expected}."
        )
    return name, array.reshape(shape)


def parse_infer_request(body: bytes) -> InferRequest:
    """Decode an inference request body into numpy arrays; shapes are not yet checked."""
    try:
        obj = _loads(body)
    except _DECODE_ERRORS:
        raise ProtocolError(
            "request body is not valid JSON; send an inference request object."
        ) from None
    if not isinstance(obj, dict):
        raise ProtocolError("request body must be a JSON object with an 'inputs' array.")
    inputs_raw = obj.get("inputs")
    if not isinstance(inputs_raw, list) or not inputs_raw:
        raise ProtocolError("request has no 'inputs' array; send at least one input tensor.")
    inputs: dict[str, np.ndarray] = {}
    for i, raw in enumerate(inputs_raw):
        name, array = _tensor_from_json(raw, i)
        if name in inputs:
            raise ProtocolError(f"input '{name}' appears twice; send each input once.")
        inputs[name] = array
    outputs_raw = obj.get("outputs")
    requested: list[str] | None = None
    if outputs_raw is not None:
        if not isinstance(outputs_raw, list) or not all(
            isinstance(o, dict) and isinstance(o.get("name"), str) for o in outputs_raw
        ):
            raise ProtocolError("'outputs' must be an array of objects with a 'name'.")
        requested = [o["name"] for o in outputs_raw]
    request_id = obj.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise ProtocolError("'id' must be a string when given.")
    params = obj.get("parameters") or {}
    if not isinstance(params, dict):
        raise ProtocolError("'parameters' must be an object when given.")
    return InferRequest(inputs, request_id, requested, params)


def check_inputs(
    request: InferRequest, spec: TensorSpec, max_batch_size: int, model: str
) -> np.ndarray:
    """The one input array of a single-input model, checked against its signature."""
    if spec.name not in request.inputs:
        got = ", ".join(repr(n) for n in request.inputs)
        raise ProtocolError(
            f"model '{model}' has input '{spec.name}' but the request sent {got}; "
            f"name the input '{spec.name}'."
        )
    extra = [n for n in request.inputs if n != spec.name]
    if extra:
        raise ProtocolError(
            f"model '{model}' has no input named {extra[0]!r}; its only input is '{spec.name}'."
        )
    array = request.inputs[spec.name]
    datatype = datatype_of_array(array)
    if datatype != spec.datatype:
        raise ProtocolError(
            f"input '{spec.name}' of model '{model}' has datatype {spec.datatype}, "
            f"but the request sent {datatype}."
        )
    if array.ndim != len(spec.shape) + 1 or tuple(array.shape[1:]) != spec.shape:
        raise ProtocolError(
            f"input '{spec.name}' of model '{model}' has shape {[-1, *spec.shape]} "
            f"(batch first), but the request sent {list(array.shape)}."
        )
    batch = array.shape[0]
    if batch < 1 or batch > max_batch_size:
        raise ProtocolError(
            f"input '{spec.name}' has batch size {batch}; model '{model}' accepts 1 to "
            f"{max_batch_size} per request."
        )
    return array


def check_requested_outputs(request: InferRequest, outputs: list[TensorSpec], model: str) -> None:
    known = {o.name for o in outputs}
    for name in request.requested_outputs or []:
        if name not in known:
            raise ProtocolError(
                f"model '{model}' has no output named {name!r}; its outputs are "
                f"{', '.join(sorted(known))}."
            )


def infer_response_body(
    model: str, version: str, request_id: str | None, output: TensorSpec, array: np.ndarray
) -> bytes:
    body: dict[str, Any] = {
        "model_name": model,
        "model_version": version,
        "outputs": [
            {
                "name": output.name,
                "datatype": datatype_of_array(array),
                "shape": list(array.shape),
                "data": _flat(array),
            }
        ],
    }
    if request_id is not None:
        body["id"] = request_id
    return _dumps(body)


def _flat(array: np.ndarray) -> Any:
    flat = np.ascontiguousarray(array).reshape(-1)
    # orjson writes float32/int arrays natively; float16 and bool it does not, lists it does.
    return flat if flat.dtype in (np.float32, np.float64, np.int32, np.int64) else flat.tolist()


def error_body(message: str) -> bytes:
    return _dumps({"error": message})


def encode_request_bytes(
    array: np.ndarray, input_name: str = "input", request_id: str | None = None
) -> bytes:
    """A client-side helper: the JSON body of an inference request for one input."""
    req = encode_request(array, input_name, request_id)
    req["inputs"][0]["data"] = _flat(array)
    return _dumps(req)


def encode_request(
    array: np.ndarray, input_name: str = "input", request_id: str | None = None
) -> dict[str, Any]:
    """A client-side helper: the JSON object of an inference request for one input."""
    req: dict[str, Any] = {
        "inputs": [
            {
                "name": input_name,
                "shape": list(array.shape),
                "datatype": datatype_of_array(array),
                "data": array.reshape(-1).tolist(),
            }
        ]
    }
    if request_id is not None:
        req["id"] = request_id
    return req


def decode_output(response: dict[str, Any], index: int = 0) -> np.ndarray:
    """A client-side helper: one output tensor of an inference response as a numpy array."""
    out = response["outputs"][index]
    return np.asarray(out["data"], dtype=DATATYPES[out["datatype"]]).reshape(out["shape"])


# Schemas for the OpenAPI document; requests are parsed by hand for speed (see module docstring).
class RequestInput(BaseModel):
    name: str
    shape: list[int] = Field(description="Full shape, batch axis first, e.g. [1, 3, 32, 32].")
    datatype: str = Field(description="BOOL, UINT8..UINT64, INT8..INT64, FP16, FP32, FP64, BYTES.")
    parameters: dict[str, Any] | None = None
    data: list[Any] = Field(description="Row-major values, flat or nested.")


class RequestOutput(BaseModel):
    name: str
    parameters: dict[str, Any] | None = None


class InferenceRequest(BaseModel):
    id: str | None = None
    parameters: dict[str, Any] | None = None
    inputs: list[RequestInput]
    outputs: list[RequestOutput] | None = None


class ResponseOutput(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, Any] | None = None
    data: list[Any]


class InferenceResponse(BaseModel):
    model_name: str
    model_version: str | None = None
    id: str | None = None
    parameters: dict[str, Any] | None = None
    outputs: list[ResponseOutput]


class ErrorResponse(BaseModel):
    error: str


class TensorMetadata(BaseModel):
    name: str
    datatype: str
    shape: list[int]


class ModelMetadata(BaseModel):
    name: str
    versions: list[str] | None = None
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


class ServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


class ModelReady(BaseModel):
    name: str
    ready: bool


class ServerHealth(BaseModel):
    live: bool | None = None
    ready: bool | None = None
