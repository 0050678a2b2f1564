"""`hpcml profile` on 2 real processes: a Chrome trace per rank that holds the profiled steps and
hpcml's phase ranges, a breakdown per rank with a collective in flight (DDP's all-reduce), the
rank-0 breakdown in summary.json and printed."""

from __future__ import annotations

import json

import pytest
from tests.conftest import run_hpcml, summary

pytestmark = pytest.mark.slow


def test_profile_two_processes_writes_traces_and_a_breakdown(tmp_path):
    run = tmp_path / "run"
    proc = run_hpcml("profile", "examples/digits_cnn.yaml", "model.name=mlp", "model.args={hidden: 32}",
                     "data.batch_size=16", "--steps", "2", "--nproc", "2", "--run-dir", str(run),
                     "--quiet")
    assert "a collective in flight" in proc.stdout
    # Kineto's C++ `USDT:` lines at each profiler start and stop are held back on every rank.
    assert "USDT:" not in proc.stderr and "USDT:" not in proc.stdout
    assert "  op " in proc.stdout and " calls" in proc.stdout  # the top ops, printed
    for rank in (0, 1):
        # *.pt.trace.json: what TensorBoard's profiler plugin finds.
        trace = json.loads((run / "profile" / f"trace-rank-{rank}.pt.trace.json").read_text())
        names = [e.get("name", "") for e in trace["traceEvents"]]
        assert sum(n.startswith("ProfilerStep#") for n in names) == 2  # --steps 2
        for phase in ("hpcml.data", "hpcml.forward", "hpcml.backward", "hpcml.optimizer"):
            assert names.count(phase) == 2, phase  # once per profiled step
        b = json.loads((run / "profile" / f"breakdown-rank-{rank}.json").read_text())
        assert b["steps"] == 2
        # DDP all-reduces the gradients every step: some collective ran during the step.
        assert b["communication_in_flight_s"] > 0
        assert b["top_ops"] and all(op["self_cpu_s"] >= 0 for op in b["top_ops"])
    s = summary(run)
    assert s["steps"] == 5 and s["profile"]["steps"] == 2  # 2 skipped + 1 warm-up + 2 recorded
    breakdown = json.loads((run / "profile" / "breakdown-rank-0.json").read_text())
    assert s["profile"] == {**breakdown, "top_ops": breakdown["top_ops"][:5]}


def test_a_slower_loader_raises_the_data_share(tmp_path):
    """The property hpcml.train.profile's docstring names: the same model, batch and steps with a
    loader that does more work per batch (data.augment: a random crop and flip of each sample,
    in the training process) spend a larger share of the profiled step waiting for data.
    Shares of two real runs are compared; no time is asserted. The loader's extra time lands in
    data, not in the rest of the step (a fetch outside the `hpcml.data` range would put it in
    "other")."""
    found = {}
    for name, extra in (("plain", []), ("augmented", ["data.augment=true"])):
        run = tmp_path / name
        run_hpcml("profile", "examples/digits_cnn.yaml", "model.name=mlp", "model.args={hidden: 256}",
                  "data.batch_size=64", *extra, "--steps", "5", "--run-dir", str(run), "--quiet")
        found[name] = summary(run)["profile"]
    plain, slow = found["plain"], found["augmented"]
    assert slow["data_share"] > plain["data_share"] and slow["data_s"] > plain["data_s"]
    assert slow["data_share"] - plain["data_share"] > slow["other_share"] - plain["other_share"]
