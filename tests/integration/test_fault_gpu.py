"""GPU paths of fault tolerance: background checkpoints staged from device memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fault_util import config_dict, run_engine, summary

from hpcml.train.checkpoint import store as ckpt

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_async_checkpoints_from_gpu_memory_are_complete_and_resume(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train = {"device": "cuda", "max_steps": 20, "checkpoint_every": 5, "checkpoint_async": True}
    # The schedule's horizon is fixed at 30 steps so that resuming to 30 is the same schedule
    # (a resume that would move it is refused: checkpoint.check_lr_horizon).
    optim = {"decay_steps": 30}
    assert run_engine(config_dict(train=train, optim=optim), run) == ("ok", "finished")
    saved = summary(run)["fault"]["checkpoints"]
    assert saved["count"] == 4 and saved["background"] is True
    latest = ckpt.find_latest(run / "checkpoints")
    assert latest is not None and latest.name == "step-20" and ckpt.verify(latest) is None

    more = {**train, "max_steps": 30}
    assert run_engine(config_dict(train=more, optim=optim), run, resume="auto") == ("ok", "finished")
    assert summary(run)["resumed_from"] == str(latest) and summary(run)["steps"] == 30


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_step_timer_counts_device_time_of_a_slow_backward_without_a_sync_per_step() -> None:
    import importlib.util
    import time

    from hpcml.train.fault.straggler import StepTimer, nvml_state

    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    timer = StepTimer(dev)
    timer.attach(model, opt)

    def slow(grad: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(100_000_000)  # a device-side delay in backward; the host goes on
        return grad

    steps = 3
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        timer.forward_started()
        out = model(torch.randn(8, 64, device=dev))
        out.register_hook(slow)
        out.sum().backward()
        opt.step()
        opt.zero_grad()
        timer.end_step(0.0)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / steps
    compute, _ = timer.window_s()
    # The events span the device's sleep (about 50 ms at 2 GHz per step): the host-only gaps
    # between spans (zero_grad, the loop) are a few hundred microseconds, far under 10 %; the
    # spans cannot exceed the synchronized wall time (1 ms: event timing and launch slack).
    assert 0.9 * wall <= compute <= wall + 1e-3, (compute, wall)
    state = nvml_state(dev)
    if importlib.util.find_spec("pynvml") is None:
        assert state is None
    else:
        assert state is not None and "error" not in state, state
        assert 0 < state["sm_clock_mhz"] <= state["sm_clock_max_mhz"]
        assert isinstance(state["clock_event_reasons"], list)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_profile_on_a_gpu_writes_a_memory_snapshot(tmp_path: Path) -> None:
    """`hpcml profile` on CUDA: the allocator's history for PyTorch's memory viewer (a pickle
    hpcml writes and never reads) and the peak allocated bytes in the breakdown; the step split
    by the device timeline of the real trace (kernels found, compute seen, no collective on one
    process) and printed."""
    import json

    from tests.conftest import run_hpcml

    run = tmp_path / "run"
    proc = run_hpcml("profile", "examples/digits_cnn.yaml", "train.device=cuda", "--steps", "3",
                     "--run-dir", str(run), "--quiet")
    snap = run / "profile" / "memory-snapshot-rank-0.pickle"
    assert snap.stat().st_size > 1000
    breakdown = json.loads((run / "profile" / "breakdown-rank-0.json").read_text())
    assert breakdown["memory_snapshot"] == snap.name
    assert breakdown["cuda_max_memory_allocated_bytes"] > 0
    device = breakdown["device"]
    assert device["steps"] == 3 and device["kernels"] > 0 and device["compute_s"] > 0
    assert device["communication_in_flight_s"] == 0  # one process: no NCCL kernel
    for part in ("compute", "communication", "memcpy", "data", "host_overhead", "idle"):
        assert 0 <= device[f"{part}_s"] <= device["step_s"], part
    assert "device timeline (median step)" in proc.stdout
