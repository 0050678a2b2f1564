"""Open Inference Protocol v2 REST bodies: JSON tensors and the binary tensor data extension.

A request body is JSON, or (binary extension, what tritonclient and KServe's client send by
default) a JSON header of `Inference-Header-Content-Length` bytes followed by the raw data of
each input that has a `binary_data_size` parameter, in input order. Outputs come back as binary
when an output asks with `"parameters": {"binary_data": true}` or the request with
`"binary_data_output": true`. JSON is parsed with orjson (4x faster than the stdlib on long
float arrays, which is most of a request's cost on CPU). Every problem a client can cause
becomes a `ProtocolError` whose message is sent back as `{"error": "..."}` with HTTP 400.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from hpcml.serve.codec.tensors import (
    DATATYPES,
    DecodeBudget,
    ProtocolError,
    check_shape,
    convert,
    datatype_of_array,
    dtype_of,
    from_json_data,
    from_raw,
    to_json_data,
    to_raw,
)

__all__ = [
    "DATATYPES",
    "HEADER_LENGTH",
    "InferRequest",
    "ProtocolError",
    "TensorSpec",
    "check_inputs",
    "check_requested_outputs",
    "datatype_of",
    "datatype_of_array",
    "decode_output",
    "encode_binary_request",
    "encode_request",
    "encode_request_bytes",
    "error_body",
    "infer_response_body",
    "parse_header_length",
    "parse_infer_request",
]

HEADER_LENGTH = "inference-header-content-length"
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


def _loads(body: bytes | memoryview) -> Any:
    return orjson.loads(body)


def _dumps(obj: Any) -> bytes:
    return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY)


def datatype_of(dtype_name: str) -> str:
    """Protocol datatype for a dtype name as written in model.json (`float32` -> `FP32`)."""
    dt = _TORCH_NAME_TO_DATATYPE.get(dtype_name)
    if dt is None:
        raise ValueError(f"dtype {dtype_name!r} has no Open Inference Protocol datatype")
    return dt


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
    """Arrays as sent; `datatypes` holds the datatype each was sent as."""
    request_id: str | None
    requested_outputs: list[str] | None
    parameters: dict[str, Any]
    datatypes: dict[str, str] = field(default_factory=dict)
    binary_outputs: dict[str, bool] = field(default_factory=dict)
    """Output name -> send as binary; outputs not named follow `binary_output_default`."""
    binary_output_default: bool = False

    def wants_binary(self, output: str) -> bool:
        return self.binary_outputs.get(output, self.binary_output_default)


def parse_header_length(value: str | None, body_length: int) -> int | None:
    """The JSON header's length from `Inference-Header-Content-Length`, checked against the body."""
    if value is None:
        return None
    if not value.isdigit() or not value.isascii():
        raise ProtocolError(
            f"Inference-Header-Content-Length must be a non-negative integer, got {value[:40]!r}."
        )
    length = int(value)
    if length == 0 or length > body_length:
        raise ProtocolError(
            f"Inference-Header-Content-Length is {length} but the body has {body_length} bytes; "
            "it must give the length of the JSON header at the start of the body."
        )
    return length


def _bool_param(params: dict[str, Any], key: str, where: str) -> bool | None:
    value = params.get(key)
    if value is not None and not isinstance(value, bool):
        raise ProtocolError(f"{where} parameter '{key}' must be true or false.")
    return value


def _params(obj: dict[str, Any], where: str) -> dict[str, Any]:
    params = obj.get("parameters")
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise ProtocolError(f"{where} 'parameters' must be an object when given.")
    return params


def _input_tensor(
    obj: Any, index: int, binary: memoryview, offset: int, budget: DecodeBudget
) -> tuple[str, str, np.ndarray, int]:
    """(name, datatype, array, new offset into the binary section) of input #index."""
    where = f"input #{index}"
    if not isinstance(obj, dict):
        raise ProtocolError(f"{where} must be an object with name, shape, datatype and data.")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise ProtocolError(f"{where} has no 'name'; every input tensor needs one.")
    where = f"input '{name[:64]}'"
    for key in ("shape", "datatype"):
        if key not in obj:
            raise ProtocolError(f"{where} has no '{key}'; inputs need name, shape, datatype, data.")
    shape = check_shape(obj["shape"], where)
    datatype = obj["datatype"]
    dtype_of(datatype, where)
    budget.charge(shape, datatype, where)
    size = _params(obj, where).get("binary_data_size")
    if size is None:
        if "data" not in obj:
            raise ProtocolError(
                f"{where} has no 'data' and no 'binary_data_size' parameter; send one of them."
            )
        return name, datatype, from_json_data(obj["data"], datatype, shape, where), offset
    if "data" in obj:
        raise ProtocolError(f"{where} has both 'data' and 'binary_data_size'; send one of them.")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ProtocolError(f"{where} 'binary_data_size' must be a non-negative integer.")
    if offset + size > len(binary):
        raise ProtocolError(
            f"{where} claims {size} bytes of binary data but only {len(binary) - offset} remain "
            "after the JSON header (see Inference-Header-Content-Length)."
        )
    array = from_raw(binary[offset : offset + size], datatype, shape, where)
    return name, datatype, array, offset + size


def parse_infer_request(
    body: bytes, header_length: int | None = None, max_decoded_bytes: int | None = None
) -> InferRequest:
    """Decode a request body (JSON, or JSON header + binary data) into numpy arrays.

    `max_decoded_bytes` bounds the decoded size of all inputs (413 past it), checked on the
    shapes before any tensor is allocated; None: no bound beyond the body's own size."""
    view = memoryview(body)
    header = view if header_length is None else view[:header_length]
    binary = view[len(header) :]
    try:
        obj = _loads(header)
    except orjson.JSONDecodeError:
        raise ProtocolError(
            "request body is not valid JSON; send an inference request object (with binary "
            "data, set Inference-Header-Content-Length to the JSON header's length)."
        ) from None
    if not isinstance(obj, dict):
        raise ProtocolError("request body must be a JSON object with an 'inputs' array.")
    inputs_raw = obj.get("inputs")
    if not isinstance(inputs_raw, list) or not inputs_raw:
        raise ProtocolError("request has no 'inputs' array; send at least one input tensor.")
    request = InferRequest({}, None, None, _params(obj, "the request"))
    offset = 0
    budget = DecodeBudget(max_decoded_bytes)
    for i, raw in enumerate(inputs_raw):
        name, datatype, array, offset = _input_tensor(raw, i, binary, offset, budget)
        if name in request.inputs:
            raise ProtocolError(f"input '{name[:64]}' appears twice; send each input once.")
        request.inputs[name] = array
        request.datatypes[name] = datatype
    if offset != len(binary):
        raise ProtocolError(
            f"the body has {len(binary) - offset} bytes of binary data that no input claims "
            "with 'binary_data_size'."
        )
    _read_outputs(obj.get("outputs"), request)
    request_id = obj.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise ProtocolError("'id' must be a string when given.")
    request.request_id = request_id
    if "classification" in request.parameters:
        raise ProtocolError("the classification extension is not supported; omit 'classification'.")
    default = _bool_param(request.parameters, "binary_data_output", "the request")
    request.binary_output_default = bool(default)
    return request


def _read_outputs(outputs_raw: Any, request: InferRequest) -> None:
    if outputs_raw is None:
        return
    if not isinstance(outputs_raw, list) or not all(
        isinstance(o, dict) and isinstance(o.get("name"), str) for o in outputs_raw
    ):
        raise ProtocolError("'outputs' must be an array of objects with a 'name'.")
    request.requested_outputs = []
    for o in outputs_raw:
        where = f"output '{o['name'][:64]}'"
        params = _params(o, where)
        if "classification" in params:
            raise ProtocolError(
                "the classification extension is not supported; omit 'classification'."
            )
        binary = _bool_param(params, "binary_data", where)
        if binary is not None:
            request.binary_outputs[o["name"]] = binary
        request.requested_outputs.append(o["name"])


def check_inputs(
    request: InferRequest, spec: TensorSpec, max_batch_size: int, model: str
) -> np.ndarray:
    """The one input array of a single-input model, checked and converted to its signature."""
    if spec.name not in request.inputs:
        got = ", ".join(repr(n[:64]) for n in request.inputs)
        raise ProtocolError(
            f"model '{model}' has input '{spec.name}' but the request sent {got}; "
            f"name the input '{spec.name}'."
        )
    extra = [n for n in request.inputs if n != spec.name]
    if extra:
        raise ProtocolError(
            f"model '{model}' has no input named {extra[0][:64]!r}; its only input is "
            f"'{spec.name}'."
        )
    array = request.inputs[spec.name]
    sent = request.datatypes.get(spec.name) or datatype_of_array(array)
    where = f"input '{spec.name}' of model '{model}'"
    if array.ndim != len(spec.shape) + 1 or tuple(array.shape[1:]) != spec.shape:
        raise ProtocolError(
            f"{where} has shape {[-1, *spec.shape]} (batch first), but the request sent "
            f"{list(array.shape)}."
        )
    batch = array.shape[0]
    if batch < 1 or batch > max_batch_size:
        raise ProtocolError(
            f"input '{spec.name}' has batch size {batch}; model '{model}' accepts 1 to "
            f"{max_batch_size} per request."
        )
    return convert(array, sent, spec.datatype, where)


def check_requested_outputs(request: InferRequest, outputs: list[TensorSpec], model: str) -> None:
    known = {o.name for o in outputs}
    for name in request.requested_outputs or []:
        if name not in known:
            raise ProtocolError(
                f"model '{model}' has no output named {name[:64]!r}; its outputs are "
                f"{', '.join(sorted(known))}."
            )
    for name in request.binary_outputs:
        if name not in known:
            raise ProtocolError(f"model '{model}' has no output named {name[:64]!r}.")


def infer_response_body(
    model: str,
    version: str,
    request_id: str | None,
    output: TensorSpec,
    array: np.ndarray,
    binary: bool = False,
) -> tuple[bytes, int | None]:
    """(body, JSON header length or None): JSON, or JSON header + raw output when `binary`."""
    tensor: dict[str, Any] = {
        "name": output.name,
        "datatype": datatype_of_array(array),
        "shape": list(array.shape),
    }
    raw = b""
    if binary:
        raw = to_raw(array)
        tensor["parameters"] = {"binary_data_size": len(raw)}
    else:
        tensor["data"] = to_json_data(array)
    body: dict[str, Any] = {"model_name": model, "model_version": version, "outputs": [tensor]}
    if request_id is not None:
        body["id"] = request_id
    header = _dumps(body)
    if not binary:
        return header, None
    return header + raw, len(header)


def error_body(message: str) -> bytes:
    return _dumps({"error": message})


def encode_request_bytes(
    array: np.ndarray, input_name: str = "input", request_id: str | None = None
) -> bytes:
    """A client-side helper: the JSON body of an inference request for one input."""
    req = encode_request(array, input_name, request_id)
    req["inputs"][0]["data"] = to_json_data(array)
    return _dumps(req)


def encode_binary_request(
    array: np.ndarray, input_name: str = "input"
) -> tuple[bytes, dict[str, str]]:
    """A client-side helper: (body, headers) of a request with one input as binary tensor data
    and binary outputs asked for, as tritonclient sends it."""
    raw = to_raw(array)
    tensor = {
        "name": input_name,
        "shape": list(array.shape),
        "datatype": datatype_of_array(array),
        "parameters": {"binary_data_size": len(raw)},
    }
    header = _dumps({"inputs": [tensor], "parameters": {"binary_data_output": True}})
    headers = {"content-type": "application/octet-stream", HEADER_LENGTH: str(len(header))}
    return header + raw, headers


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
    """A client-side helper: one output tensor of a JSON inference response as a numpy array."""
    out = response["outputs"][index]
    return np.asarray(out["data"], dtype=DATATYPES[out["datatype"]]).reshape(out["shape"])
