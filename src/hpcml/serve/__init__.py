"""Serving: Open Inference Protocol server, dynamic batching, versions and traffic."""
