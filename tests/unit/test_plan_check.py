"""Reading run summaries for `plan check`: the formats, the hardware, the errors."""

from __future__ import annotations

from typing import Any

import pytest

from hpcml.plan.check import check_run, setup_from_summary
from hpcml.plan.common import PlanError
from hpcml.plan.hardware import load_catalog
from hpcml.plan.perf import Calibration

CAT = load_catalog()
PARAMS = 2_474_506


def summary(**over: Any) -> dict[str, Any]:
    rank = {"params_bytes": 4 * PARAMS, "grads_bytes": 4 * PARAMS,
            "optimizer_bytes": 8 * PARAMS + 64, "model_states_bytes": 16 * PARAMS + 64,
            "peak_allocated_bytes": None}
    base: dict[str, Any] = {
        "status": "finished",
        "world_size": 2,
        "device": {"type": "cpu", "name": "x86_64", "count": 2},
        "precision": "fp32",
        "model": {"name": "simple_cnn", "args": {"num_classes": 10, "in_channels": 3},
                  "parameters": PARAMS, "forward_flops_per_sample": 83_240_960},
        "memory": {**rank, "per_rank": [rank, rank]},
        "throughput": {"samples_per_s": 100.0, "step_time_s": 0.5, "data_wait_s": 0.01},
        "config": {"model": {"name": "simple_cnn", "args": {}},
                   "data": {"batch_size": 32}, "optim": {"name": "adamw"},
                   "train": {"grad_accum": 2}, "parallel": {"strategy": "ddp"},
                   "precision": "fp32"},
    }
    base.update(over)
    return base


def test_hpcml_train_summary_is_read() -> None:
    s = setup_from_summary(summary(), CAT, "run")
    assert s.cluster.accelerator.key == "cpu" and s.cluster.devices == 2
    assert (s.layout.micro_batch, s.layout.grad_accum, s.layout.zero) == (32, 2, 0)
    assert s.model.activation_bytes_per_sample is not None  # the zoo table, args completed
    assert s.measured_step_s == pytest.approx(0.49)  # data wait taken out
    assert len(s.measured_memory) == 2
    report = check_run(s, calibration=Calibration(0.05))
    rows = {r.quantity: r for r in report.rows}
    assert rows["model_states_bytes"].ratio == pytest.approx(1.0)
    assert rows["step_time_s"].predicted is not None


@pytest.mark.parametrize("memory", [
    {"0": {"model_states_bytes": 16 * PARAMS + 64}, "1": {"model_states_bytes": 16 * PARAMS + 64}},
    [{"model_states_bytes": 16 * PARAMS + 64}],
    {"model_states_bytes": 16 * PARAMS + 64},
])
def test_other_memory_layouts(memory: Any) -> None:
    s = setup_from_summary(summary(memory=memory), CAT, "run")
    rows = {r.quantity: r for r in check_run(s, calibration=Calibration(0.05)).rows}
    assert rows["model_states_bytes"].ratio == pytest.approx(1.0)


def test_gpu_run_uses_autocast_weights_and_compares_peak_memory() -> None:
    rank = {"params_bytes": 4 * PARAMS, "grads_bytes": 4 * PARAMS,
            "optimizer_bytes": 8 * PARAMS + 64, "model_states_bytes": 16 * PARAMS + 64,
            "peak_allocated_bytes": 900_000_000}
    s = setup_from_summary(summary(
        device={"type": "cuda", "name": "NVIDIA H100 80GB HBM3", "count": 1}, world_size=1,
        precision="bf16", memory={**rank, "per_rank": [rank]}), CAT, "gpu")
    assert s.cluster.accelerator.key == "h100-sxm" and s.training.weight_mode == "amp"
    report = check_run(s)
    quantities = [r.quantity for r in report.rows]
    assert "peak_allocated_bytes" in quantities
    assert any("uncalibrated" in n for n in report.notes)
    states = next(r for r in report.rows if r.quantity == "model_states_bytes")
    assert states.ratio == pytest.approx(1.0)  # autocast keeps fp32 weights: 16 bytes/param


@pytest.mark.parametrize("over,needle", [
    ({"device": {"type": "cuda", "name": "Tesla K80"}}, "not in the hardware catalog"),
    ({"status": "failed", "model": None}, "ended 'failed'"),
    ({"config": {"parallel": {"strategy": "pipedream"}}}, "parallel.strategy"),
])
def test_unusable_summaries(over: dict[str, Any], needle: str) -> None:
    data = summary(**over)
    if data.get("model") is None:
        del data["model"]
    with pytest.raises(PlanError, match=needle):
        setup_from_summary(data, CAT, "run")


def test_a_cpu_run_is_planned_with_the_threads_each_rank_had() -> None:
    """The summary's `device.threads` sets a CPU rank's peak (the catalog's CPU peak is for 8
    cores); a summary from before threads were recorded gets the runtime's rule, the host's
    cores split between the ranks (2 cores, 2 ranks: 1 thread each)."""
    full = CAT.accelerator("cpu").peak("fp32")
    cpu = {"type": "cpu", "name": "x86_64", "count": 16}
    four = setup_from_summary(summary(device={**cpu, "threads": 4}), CAT, "run")
    assert four.cluster.accelerator.peak("fp32") == pytest.approx(full * 4 / 8)
    old = setup_from_summary(summary(), CAT, "run")
    assert old.cluster.accelerator.peak("fp32") == pytest.approx(full * 1 / 8)
    one = setup_from_summary(summary(world_size=1, device={**cpu, "count": 2}), CAT, "run")
    assert one.cluster.accelerator.peak("fp32") == pytest.approx(full * 2 / 8)
