"""`observe.tracing`: a real 1-process training run in this process with OpenTelemetry's SDK
and its in-memory exporter: one span per step with the step number, the phases inside it in
order and within its time, evaluation and checkpoint spans; nothing when tracing is off."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcml.config import load_config
from hpcml.observe.tracing import system_id_generator
from hpcml.train.engine import run

pytest.importorskip("opentelemetry.sdk")
from opentelemetry import trace  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

EXPORTER = InMemorySpanExporter()


def provider() -> None:
    current = trace.get_tracer_provider()
    if not isinstance(current, TracerProvider):  # once per process (OpenTelemetry's rule)
        sdk = TracerProvider(id_generator=system_id_generator())
        sdk.add_span_processor(SimpleSpanProcessor(EXPORTER))
        trace.set_tracer_provider(sdk)


def train(tmp_path: Path, name: str, tracing: bool) -> None:
    cfg = load_config(
        Path("examples/digits_cnn.yaml"),
        ["model.name=mlp", "model.args={hidden: 16}", "data.batch_size=16", "train.max_steps=4",
         "train.eval_every=0", "train.checkpoint_every=2", "train.log_every=2", "train.device=cpu",
         f"observe.tracing={str(tracing).lower()}"],
    )
    run(cfg, run_dir=tmp_path / name, quiet=True)


def test_steps_and_their_phases_are_spans(tmp_path: Path) -> None:
    provider()
    EXPORTER.clear()
    train(tmp_path, "off", tracing=False)
    assert EXPORTER.get_finished_spans() == ()  # off: not one span

    train(tmp_path, "on", tracing=True)
    spans = EXPORTER.get_finished_spans()
    steps = [s for s in spans if s.name == "hpcml.step"]
    assert [s.attributes["hpcml.step"] for s in steps] == [1, 2, 3, 4]
    assert all(s.attributes["hpcml.rank"] == 0 for s in steps)
    for step in steps:
        children = sorted(
            (s for s in spans if s.parent is not None and s.parent.span_id == step.context.span_id),
            key=lambda s: s.start_time,
        )
        names = [c.name for c in children]
        assert names[:4] == ["hpcml.data", "hpcml.forward", "hpcml.backward", "hpcml.optimizer"]
        for c in children:  # inside the step, in time
            assert step.start_time <= c.start_time <= c.end_time <= step.end_time
        for a, b in zip(children, children[1:], strict=False):
            assert a.end_time <= b.start_time  # one after the other, not overlapping
        if step.attributes["hpcml.step"] in (2, 4):  # checkpoint_every=2, and the last step
            assert "hpcml.checkpoint" in names, names
    # The final evaluation (eval_every=0 evaluates after the last step), inside step 4's span.
    evals = [s for s in spans if s.name == "hpcml.eval"]
    assert len(evals) == 1 and evals[0].attributes["hpcml.step"] == 4
    assert evals[0].parent is not None and evals[0].parent.span_id == steps[3].context.span_id
    # Each step is a trace of its own, with an id no seeded run repeats: train again with the
    # same seed and no trace id comes back (the SDK's default generator drew them from the
    # `random` module the run seeds, so both runs made the same ids).
    first = {s.context.trace_id for s in steps}
    EXPORTER.clear()
    train(tmp_path, "again", tracing=True)
    again = {s.context.trace_id for s in EXPORTER.get_finished_spans() if s.name == "hpcml.step"}
    assert len(first) == len(again) == 4 and not first & again
