"""The committed gRPC stubs are what grpcio-tools makes of the committed proto, and stay private."""

from __future__ import annotations

import pytest

from hpcml.serve.oip_pb import generate


def test_committed_stubs_match_a_fresh_generation(capsys: pytest.CaptureFixture[str]) -> None:
    assert generate.main(["--check"]) == 0, capsys.readouterr().out


def test_stubs_live_in_a_private_pool_beside_tritonclients_own() -> None:
    # tritonclient registers the same inference.* names in protobuf's default pool; with ours
    # there too, importing both in one process fails with "duplicate symbol".
    import tritonclient.grpc.service_pb2 as triton_pb

    from hpcml.serve.oip_pb import grpc_predict_v2_pb2 as pb

    assert pb.DESCRIPTOR.pool is not triton_pb.DESCRIPTOR.pool
    request = pb.ModelInferRequest(model_name="m", raw_input_contents=[b"\x00" * 4])
    # Wire-compatible with Triton's message of the same name.
    again = triton_pb.ModelInferRequest.FromString(request.SerializeToString())
    assert again.model_name == "m" and list(again.raw_input_contents) == [b"\x00" * 4]
