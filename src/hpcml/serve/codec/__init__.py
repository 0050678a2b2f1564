"""The wire's tensors: OIP v2 JSON and binary-extension request and response bodies (`oip`),
datatypes, shapes, raw bytes and checked conversions shared with gRPC (`tensors`). The lowest
room of `serve`: it imports nothing of the server."""
