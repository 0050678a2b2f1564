"""Benchmark suite helpers."""
