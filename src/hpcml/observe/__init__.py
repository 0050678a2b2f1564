"""Observation: Prometheus metrics, GPU readings, profiles."""
