"""Serving: Open Inference Protocol server, dynamic batching, versions and traffic.

Its rooms, each importing only those below it (import-linter's `serve:` contracts in
pyproject.toml enforce the order):

- `protocol/`: the front. The HTTP app, gRPC (KServe v2 and Triton's extensions), TLS, the
  token gate and the admin endpoints, header timeouts, per-request traces; it mounts
  `generate/` and hands requests to `traffic/`.
- `generate/`: text generation (engine, paged KV cache, sampling, OpenAI API) for `gpt` exports.
- `traffic/`: where requests go: the router and its version policies, alias following,
  admission limits, drift monitoring.
- `runtime/`: what computes: backends, the dynamic batcher, the model repository, ONNX export.
- `codec/` and `oip_pb/`: the wire's tensors (OIP JSON, binary extension, protobuf); they import
  nothing of the server, so runtime and traffic may use them without a circle.
- `config`, `metrics`, `tokens`: the serve config's schema, the Prometheus metrics and who may
  call what (roles, scopes, rate limits of bearer tokens), used by every room.

`loadtest*` are clients: they use the codec only. `testing` starts servers for the tests.
"""
