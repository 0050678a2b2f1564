"""OpenTelemetry tracers for hpcml's training runs and servers (`observe.tracing`,
`hpcml serve --tracing`).

A tracer provider the program set (library use, tests) is used as it is; otherwise spans go by
OTLP/HTTP to $OTEL_EXPORTER_OTLP_ENDPOINT (or $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT), with trace
ids from the OS's randomness. With neither set, tracing is off: the exporter's own default,
localhost:4318, made every run without a collector there spend seconds retrying and print
connection errors.
"""

from __future__ import annotations

import os
from typing import Any

from hpcml.errors import ConfigError

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
NO_ENDPOINT = (
    "{what}: no OTLP endpoint is set ($OTEL_EXPORTER_OTLP_ENDPOINT); tracing is off. Set it "
    "to your collector, e.g. http://localhost:4318."
)


def system_id_generator() -> Any:
    """Trace and span ids from the OS's randomness. OpenTelemetry's default draws from Python's
    `random`, which a run seeds (train.seed): every run with the same seed, and every rank,
    would then make the same trace ids, and a tracing backend would merge their traces."""
    import random

    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    class SystemIdGenerator(RandomIdGenerator):
        _random = random.SystemRandom()

        def generate_span_id(self) -> int:
            return self._random.getrandbits(64) or 1

        def generate_trace_id(self) -> int:
            return self._random.getrandbits(128) or 1

    return SystemIdGenerator()


def start_tracer(scope: str, resource: dict[str, Any], what: str) -> Any:
    """The tracer named `scope` from the program's provider, or from a new OTLP/HTTP one whose
    resource is `resource`; None when neither a provider nor an endpoint is set (the caller
    says so once: NO_ENDPOINT). `what` names the setting in the one-sentence error when the
    OTLP exporter is not installed."""
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):  # nobody configured one: OTLP
        if not any(os.environ.get(v) for v in ENDPOINT_VARIABLES):
            return None
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise ConfigError(
                f"{what} exports by OTLP and needs its exporter; install it with "
                f"pip install opentelemetry-exporter-otlp-proto-http, or turn {what} off."
            ) from None
        provider = TracerProvider(
            resource=Resource.create(resource), id_generator=system_id_generator()
        )
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        trace.set_tracer_provider(provider)
    return provider.get_tracer(scope)


def flush_tracer(tracer: Any) -> None:
    if tracer is None:
        return
    from opentelemetry import trace

    flush = getattr(trace.get_tracer_provider(), "force_flush", None)
    if flush is not None:
        flush()
