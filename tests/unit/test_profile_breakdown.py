"""The step-time breakdown's arithmetic on events whose times are known (the integration test
in test_profile_run.py runs the real profiler)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hpcml.train.profile import breakdown, is_comm


def ev(name: str, start: float, end: float, thread: int = 1) -> SimpleNamespace:
    return SimpleNamespace(name=name, thread=thread, time_range=SimpleNamespace(start=start, end=end))


def test_parts_of_a_step_and_collectives_counted_once_across_threads() -> None:
    us = 1e6  # times in microseconds, as the profiler's
    events = [
        # Two steps of 1.0 s and 2.0 s on the loop's thread 1.
        ev("ProfilerStep*", 0, 1.0 * us), ev("ProfilerStep*", 1.0 * us, 3.0 * us),
        ev("hpcml.data", 0, 0.1 * us), ev("hpcml.forward", 0.1 * us, 0.4 * us),
        ev("hpcml.backward", 0.4 * us, 0.8 * us), ev("hpcml.optimizer", 0.8 * us, 0.9 * us),
        ev("hpcml.data", 1.0 * us, 1.6 * us), ev("hpcml.forward", 1.6 * us, 2.0 * us),
        ev("hpcml.backward", 2.0 * us, 2.6 * us), ev("hpcml.optimizer", 2.6 * us, 2.8 * us),
        # A phase range on another thread is not the loop's and does not count.
        ev("hpcml.data", 0, 0.5 * us, thread=9),
        # Step 1: an all-reduce on gloo's thread 7 from 0.5 to 0.7 s, its nested gloo op inside
        # and a launch on the loop's thread overlapping it: 0.2 s in flight, counted once.
        ev("c10d::allreduce_", 0.5 * us, 0.55 * us), ev("gloo:all_reduce", 0.5 * us, 0.7 * us, 7),
        ev("gloo:all_reduce", 0.6 * us, 0.65 * us, 8),
        # Step 2: 0.5 s of collectives.
        ev("gloo:all_reduce", 2.2 * us, 2.7 * us, 7),
        # Not collectives, despite the thread.
        ev("aten::mm", 0.5 * us, 0.9 * us, 7),
    ]
    b = breakdown(events)
    assert b["steps"] == 2
    # Medians over the two steps: step 1.5 s; data (0.1, 0.6) -> 0.35; compute (0.8, 1.2) -> 1.0;
    # other (0.1, 0.2) -> 0.15; in flight (0.2, 0.5) -> 0.35.
    assert b["step_s"] == pytest.approx(1.5)
    assert b["data_s"] == pytest.approx(0.35)
    assert b["compute_s"] == pytest.approx(1.0)
    assert b["other_s"] == pytest.approx(0.15)
    assert b["communication_in_flight_s"] == pytest.approx(0.35)
    assert b["communication_in_flight_share"] == pytest.approx(0.35 / 1.5)


def test_no_collective_on_one_process_and_names() -> None:
    events = [ev("ProfilerStep*", 0, 10), ev("hpcml.forward", 0, 6), ev("aten::addmm", 1, 5)]
    b = breakdown(events)
    assert b["communication_in_flight_s"] == 0 and b["other_share"] == pytest.approx(0.4)
    assert all(is_comm(n) for n in ("nccl:all_reduce", "gloo:broadcast", "c10d::reduce_scatter_"))
    assert not any(is_comm(n) for n in ("aten::mm", "Optimizer.step#AdamW.step", "hpcml.data"))
    # An ATen op named like a collective is not one (it counted as communication before).
    assert not any(is_comm(n) for n in ("aten::broadcast_tensors", "aten::broadcast_to"))
    assert is_comm("_c10d_functional::all_reduce")
    assert breakdown([ev("aten::mm", 0, 1)]) == {"steps": 0}
