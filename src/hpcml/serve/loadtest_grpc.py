"""The load generator's gRPC sender: the same request as REST, as one ModelInfer call.

The body built for REST (JSON or binary tensor data) is decoded once by the server's own
parser and re-encoded as a `ModelInferRequest` with `raw_input_contents`, what tritonclient
sends; each call's outcome is recorded as 200 for OK or the gRPC status code's name.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from hpcml.serve.codec.oip import HEADER_LENGTH, parse_header_length, parse_infer_request
from hpcml.serve.codec.tensors import to_raw
from hpcml.serve.oip_pb import grpc_predict_v2_pb2 as pb
from hpcml.serve.oip_pb import grpc_predict_v2_pb2_grpc as pb_grpc


def grpc_sender(
    target: str,
    model: str,
    version: str | None,
    body: bytes,
    headers: dict[str, str],
    timeout_s: float,
) -> tuple[Callable[[], Awaitable[int | str]], Any]:
    """(send, channel): `send()` makes one ModelInfer call on `channel` (close it at the end)."""
    length = parse_header_length(headers.get(HEADER_LENGTH), len(body))
    request = parse_infer_request(body, length)
    msg = pb.ModelInferRequest(model_name=model, model_version=version or "")
    for name, array in request.inputs.items():
        msg.inputs.add(name=name, datatype=request.datatypes[name], shape=list(array.shape))
        msg.raw_input_contents.append(to_raw(array))
    channel = grpc.aio.insecure_channel(target)
    infer = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer

    async def send() -> int | str:
        try:
            await infer(msg, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            return str(exc.code().name)  # DEADLINE_EXCEEDED too: the client's or the server's
        return 200

    return send, channel
