"""benchmarks/llm_serving_http.py --merge joins invocations made at other rates, and the README
row's goal verdicts for it come from the numbers (docs/gen/headlines.http_readme)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for folder in (ROOT / "benchmarks", ROOT / "docs" / "gen"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

import headlines  # noqa: E402
import llm_serving_http as bench  # noqa: E402


def point(rate: float, tokens_per_s: float, p99_ms: float) -> dict:
    return {"rate": rate, "errors": 0, "output_tokens_per_s": tokens_per_s,
            "itl_ms": {"p99": p99_ms}}  # fmt: skip


def result(curves: list[dict], command: str) -> dict:
    workload = {"positions_bound": 2.5, "flops_ratio": 2.0, "curves": curves, "equal_itl": []}
    return {"title": "t", "note": "n", "command": command, "workloads": {"long-tailed": workload}}


def test_merge_joins_each_repetition_and_recomputes_the_ratio(tmp_path: Path) -> None:
    # Low rates: neither server saturated (equal throughput). High rates: continuous keeps up
    # (200 tok/s at 90 ms), static saturates at 80; a merge that kept one file's points only, or
    # paired repetition 0 of one with repetition 1 of the other, gives another ratio.
    low = [
        {"continuous": [point(1, 50, 40)], "static": [point(1, 50, 40)]},
        {"continuous": [point(1, 60, 40)], "static": [point(1, 60, 40)]},
    ]
    high = [{"continuous": [point(7, 200, 90)], "static": [point(7, 80, 60)]},
            {"continuous": [point(7, 150, 90)], "static": [point(7, 75, 60)]}]  # fmt: skip
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(result(low, "run a")))
    b.write_text(json.dumps(result(high, "run b")))
    args = argparse.Namespace(merge=[b, a], itl_objectives=[50.0, 100.0])
    merged = bench.merge(args)
    w = merged["workloads"]["long-tailed"]
    assert [[p["rate"] for p in rep["continuous"]] for rep in w["curves"]] == [[1, 7], [1, 7]]
    at_50, at_100 = w["equal_itl"]
    # At 50 ms only the low rate qualifies, for both modes: 1x in both repetitions.
    assert [r["ratio"] for r in at_50["repetitions"]] == [1.0, 1.0]
    assert [r["ratio"] for r in at_100["repetitions"]] == [200 / 80, 150 / 75]
    assert at_100["ratio"] == {"median": 2.25, "min": 2.0, "max": 2.5}
    assert "run a" in merged["command"] and "run b" in merged["command"]


def test_readme_verdicts_follow_the_numbers() -> None:
    def doc(ratios: list[float], bound: float) -> dict:
        reps = [{"ratio": r} for r in ratios]
        w = {"positions_bound": bound, "equal_itl": [{"repetitions": reps}]}
        return {"workloads": {"long-tailed": w, "uniform": w}}

    short = headlines.http_readme(doc([2.40, 2.41, 2.42], 2.69))  # 89.6% of the bound
    assert ">= 2x met" in short and "within 10% of the bound not met" in short
    close = headlines.http_readme(doc([2.43, 2.45], 2.69))  # 90.7%
    assert "within 10% of the bound met" in close
    low = headlines.http_readme(doc([1.9, 1.95, 2.2], 2.2))
    assert ">= 2x not met" in low
