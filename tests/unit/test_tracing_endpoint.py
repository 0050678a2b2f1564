"""Tracing without a collector: `observe.tracing` / `serve --tracing` with no OTLP endpoint set
and no tracer provider of the program's is off, at once and without a word from OpenTelemetry
(the exporter's default, localhost:4318, made a run spend seconds retrying and print connection
errors); with an endpoint set it exports there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PROBE = """
import os
from hpcml.observe.tracing import start_tracer
print(start_tracer("probe", {}, "observe.tracing") is None)
os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = "http://127.0.0.1:9"
print(start_tracer("probe", {}, "observe.tracing") is None)
"""


def test_no_endpoint_means_no_tracer_and_an_endpoint_means_one() -> None:
    # A fresh interpreter: no tracer provider set by another test in this process.
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["PYTHONPATH"] = str(SRC)
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False"]
