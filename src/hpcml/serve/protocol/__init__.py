"""The front: the OIP HTTP app, gRPC (KServe v2 and Triton's extensions, Triton's configuration
and statistics), request schemas for the OpenAPI document, header timeouts and per-request
traces. The top room of `serve`: it may import every other one."""
