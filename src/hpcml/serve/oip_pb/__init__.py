"""Python stubs of the Open Inference Protocol v2 gRPC service (`inference.GRPCInferenceService`).

`grpc_predict_v2.proto` is KServe's official file (docs/predict-api/v2 in kserve/kserve), kept
byte for byte. The `_pb2*.py(i)` files beside it are generated from it by grpcio-tools; do not
edit them, run `python -m hpcml.serve.oip_pb.generate` (needs the `dev` extra) instead.
`tests/unit/test_serve_grpc_stubs.py` checks that the committed files are what it writes.

The one change to protoc's output: the descriptors go to a private `DescriptorPool`, not the
process-wide default one, because Triton's and KServe's client packages register the same
`inference.*` names in the default pool, and a process that holds a server and such a client
(tests, notebooks) would otherwise fail with "duplicate symbol".
"""
