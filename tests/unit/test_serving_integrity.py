"""benchmarks/serving_integrity.py: the serving benchmark's checks against fooling itself,
on the published result that did (serving_xeon.json) and on small hand-made steps."""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _integrity() -> Any:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(
        "serving_integrity", ROOT / "benchmarks" / "serving_integrity.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


integrity = _integrity()


def step(rate: float, throughput: float, p99: float, valid: bool = True) -> dict[str, Any]:
    return {
        "target_rate": rate,
        "throughput": throughput,
        "errors": {},
        "latency_all_ms": {"p99": p99},
        "valid": valid,
    }


def test_the_published_result_was_not_monotone_and_pooled_steps_are() -> None:
    # serving_xeon.json: hpcml-batched binary, repetition 3, 1363/s at p99 <= 50 ms but
    # 1143/s at <= 100 ms (its bisections ran apart). The check refuses that result.
    runs = json.loads((ROOT / "benchmarks/results/archive/serving_xeon.json").read_text())["runs"]
    with pytest.raises(SystemExit, match="is below"):
        integrity.check_monotone(runs)
    pooled = {row: integrity.pool_repetition(by, [50.0, 100.0]) for row, by in runs.items()}
    integrity.check_monotone(pooled)
    binary = pooled["hpcml-batched binary"]
    # Repetition 3's 100 ms capacity is its 50 ms bisection's 1363/s step (p99 under 50 ms);
    # repetition 1's 50 ms capacity is the 100 ms bisection's 1247/s step (p99 47.1 ms), which
    # its own 50 ms bisection (509/s) had missed.
    expected = [1246.589478113356, 1363.1428315963853, 1363.2870840281566]
    assert [r["capacity_rps"] for r in binary["50"]] == pytest.approx(expected)
    assert [r["capacity_rps"] for r in binary["100"]] == pytest.approx(expected)


def test_a_step_the_generator_fell_behind_on_is_never_a_pass() -> None:
    steps = [step(100, 100, 5), step(200, 199, 8), step(400, 390, 9, valid=False)]
    assert not integrity.sustained(steps[2], 50)
    found = integrity.capacity_from_steps(steps, 50)
    assert found["capacity_rps"] == 199 and found["invalid_steps"] == 1
    assert found["generator_limited"]  # the lagged step lies above the capacity
    below = integrity.capacity_from_steps([step(100, 100, 5, valid=False), step(200, 199, 8)], 50)
    assert below["capacity_rps"] == 199 and not below["generator_limited"]
    # An error fails the step whatever its p99.
    failed = {**step(300, 290, 4), "errors": {"503": 1}}
    assert integrity.capacity_from_steps([failed], 50)["capacity_rps"] == 0.0


def test_pooled_capacity_uses_every_objective_s_steps_of_its_repetition_only() -> None:
    by_slo = {
        "50": [{"steps": [step(100, 100, 30), step(200, 198, 45)]}, {"steps": [step(100, 99, 20)]}],
        "100": [{"steps": [step(150, 150, 90)]}, {"steps": [step(300, 295, 60)]}],
    }
    pooled = integrity.pool_repetition(copy.deepcopy(by_slo), [50.0, 100.0])
    assert [r["capacity_rps"] for r in pooled["50"]] == [198, 99]
    # Repetition 1 at 100 ms: its 50 ms step at 198/s beats the 100 ms bisection's 150/s; the
    # 295/s of repetition 2 never leaks into repetition 1.
    assert [r["capacity_rps"] for r in pooled["100"]] == [198, 295]


def test_ratios_are_per_repetition_with_their_spread() -> None:
    cap = {
        "hpcml-batched": [300.0, 200.0, 500.0],
        "hpcml-bs1": [100.0, 100.0, 100.0],
        "litserve": [100.0, 200.0, 100.0],
        "ray": [150.0, 50.0, 50.0],
    }
    r = integrity.ratios(cap)
    assert r["batched_vs_bs1"] == {"median": 3.0, "min": 2.0, "max": 5.0, "runs": [3.0, 2.0, 5.0]}
    # The best peer is chosen in each repetition: 150 (ray), 200 (litserve), 100 (litserve).
    assert r["hpcml_vs_best_peer"]["runs"] == [2.0, 1.0, 5.0]
    assert r["hpcml_vs_best_peer"]["median"] == 2.0  # a ratio of medians would say 300/100 = 3
    assert r["hpcml_vs_ray"]["runs"] == [2.0, 4.0, 10.0]
    assert r["binary_vs_json_batched"] is None  # no binary rows: no ratio, not a zero


def test_goals_say_met_or_not_from_the_median_ratio() -> None:
    cap = {
        "hpcml-batched": [250.0, 290.0, 310.0],
        "hpcml-bs1": [100.0, 100.0, 100.0],
        "litserve": [200.0, 200.0, 200.0],
    }
    summary = {
        "50": {
            "capacity_rps": {k: integrity.spread(v) for k, v in cap.items()},
            "ratios": integrity.ratios(cap),
        }
    }
    goals = integrity.goals(summary, [600.0, 600.0, 600.0])
    assert goals["p99<=50ms json vs best peer"] == {"median": 1.45, "goal": 1.2, "met": True}
    assert goals["p99<=50ms json batching"] == {"median": 2.9, "goal": 3.0, "met": False}
    raw = goals["p99<=50ms hpcml-batched vs raw batched forward"]
    assert raw["median"] == pytest.approx(290 / 600) and not raw["met"]


def test_recheck_of_the_published_result_drops_lagged_steps_and_is_monotone() -> None:
    report = json.loads((ROOT / "benchmarks/results/archive/serving_xeon.json").read_text())
    before = copy.deepcopy(report)
    checked = integrity.recheck(report, max_send_lag_ms=10.0)
    assert report == before  # the recorded result is not changed
    runs = checked["runs"]["hpcml-batched binary"]
    lagged = [st for st in runs["100"][0]["steps"] if not st["valid"]]
    # The 100 ms bisection of repetition 1 stepped to 2560/s with a send lag p99 of 131.6 ms:
    # the generator, not the server, set that step's latencies.
    assert [st["target_rate"] for st in lagged][:1] == [2560.0]
    assert all(st["send_lag_ms_p99"] > 10.0 for st in lagged)
    assert runs["100"][0]["generator_limited"]
    for by_slo in checked["runs"].values():
        for tight, loose in zip(by_slo["50"], by_slo["100"], strict=True):
            assert loose["capacity_rps"] >= tight["capacity_rps"]
    text = integrity.markdown(checked)
    assert "| p99<=50ms json batching >= 3x | 2.50x | no |" in text
