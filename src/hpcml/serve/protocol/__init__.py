"""The wire: the OIP HTTP app, gRPC (KServe v2 and Triton's extensions), tensor and JSON codecs,
request schemas and header timeouts."""
