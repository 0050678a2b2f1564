"""Tracking: MLflow runs and registry, provenance."""
