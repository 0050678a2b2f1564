"""The planner's saved activations per pipeline stage (`hpcml.plan.stages`): the in-flight
micro-batches of each stage by schedule, and per-stage bytes that agree with the planner's
busiest-stage activations (`plan.memory`), from the summary a pp run writes."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from hpcml.plan.hardware import load_catalog
from hpcml.plan.memory import transformer_activation_bytes
from hpcml.plan.run_setup import setup_from_summary
from hpcml.plan.stages import predict_stages, stage_inflight_microbatches

ARGS = {"vocab_size": 256, "max_seq_len": 32, "n_layer": 4, "n_head": 2, "d_model": 32}


def pp_summary(schedule: str, m: int, pp: int = 2, ranks: list[Any] | None = None) -> dict:
    config = {
        "model": {"name": "gpt-tiny", "args": {**ARGS, "tie_embeddings": False}},
        "parallel": {"pp": pp, "pp_schedule": schedule, "microbatches": m},
        "data": {"batch_size": 8},
        "precision": "fp32",
    }
    return {
        "status": "finished",
        "world_size": pp,
        "device": {"type": "cpu", "count": 2, "threads": 1},
        "precision": "fp32",
        "model": {"name": "gpt-tiny", "args": config["model"]["args"]},
        "config": config,
        "pipeline": {"schedule": schedule, "microbatches": m, "activations_per_rank": ranks},
    }


@pytest.mark.parametrize(
    ("pp", "m", "schedule", "want"),
    [
        (2, 4, "gpipe", [4, 4]),  # every forward before the first backward
        (2, 4, "1f1b", [2, 1]),
        (4, 8, "1f1b", [4, 3, 2, 1]),
        (4, 2, "1f1b", [2, 2, 2, 1]),  # never more than the micro-batches there are
        (2, 4, "interleaved_1f1b", [None, None]),
    ],
)
def test_inflight_microbatches_per_stage(pp: int, m: int, schedule: str, want: list) -> None:
    assert [stage_inflight_microbatches(pp, m, schedule, s) for s in range(pp)] == want


def test_busiest_stage_is_plan_memorys_and_the_measured_peak_is_read() -> None:
    """Under 1F1B the first stage holds p micro-batches of its blocks and the last one holds
    one micro-batch and the output layer: the larger of the two is what `plan memory` gives
    for the layout. The measured in-flight count is the peak over the bytes per micro-batch."""
    ranks = [
        {"stages": [0], "peak_bytes": 2000, "bytes_per_microbatch": 1000.0},
        {"stages": [1], "peak_bytes": 1500, "bytes_per_microbatch": 1500.0},
    ]
    summary = pp_summary("1f1b", 4, ranks=ranks)
    rows = predict_stages(summary, load_catalog())
    setup = setup_from_summary(summary, load_catalog())
    layout = replace(setup.layout, pp=2, micro_batch=2, grad_accum=4, schedule="1f1b")
    busiest = transformer_activation_bytes(setup.model, layout, 4)
    assert max(r["predicted_activation_bytes"] for r in rows) == pytest.approx(busiest)
    assert [r["measured_inflight_microbatches"] for r in rows] == [2.0, 1.0]
    assert [r["measured_activation_bytes"] for r in rows] == [2000, 1500]
    gpipe = predict_stages(pp_summary("gpipe", 4), load_catalog())
    # GPipe: twice 1F1B's micro-batches on the first stage, all 4 on the last.
    assert gpipe[0]["predicted_activation_bytes"] == pytest.approx(
        2 * rows[0]["predicted_activation_bytes"]
    )
    assert gpipe[1]["predicted_activation_bytes"] == pytest.approx(
        4 * rows[1]["predicted_activation_bytes"]
    )
    assert all(r["measured_activation_bytes"] is None for r in gpipe)
