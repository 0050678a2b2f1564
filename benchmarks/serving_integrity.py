"""The checks that keep benchmarks/serving.py from fooling itself (issue 31, item 7).

- A step the load generator could not send on time (open-loop send lag p99 over the limit)
  measured the generator, not the server: it never counts as a pass (`sustained`), and a
  capacity whose bisection met such a step above it is flagged `generator_limited`.
- Capacity cannot fall as the objective loosens: a step that met p99 <= 50 ms also met
  p99 <= 100 ms. Each repetition's capacity at an objective is therefore the best throughput
  of *every* valid step measured for that row in that repetition (both objectives' bisections)
  that met the objective, and `check_monotone` refuses a summary where it is not monotone.
- Ratios are computed per repetition (the servers of one repetition ran back to back in
  rotating order) and reported as a median with their minimum and maximum, not as one ratio
  of medians.

`markdown` writes the report's table.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

PEERS = ("litserve", "ray", "fastapi")
GOAL_VS_BEST_PEER = 1.2
GOAL_BATCHING = 3.0
GOAL_VS_RAW = 0.5


def sustained(step: dict[str, Any], slo_ms: float) -> bool:
    """A valid step (the generator kept its schedule) with no error and p99 of every request,
    errors and client timeouts included, within the objective."""
    if step.get("valid") is False:
        return False
    lat = step.get("latency_all_ms") or {}
    return not step["errors"] and lat.get("p99", float("inf")) <= slo_ms


def capacity_from_steps(steps: list[dict[str, Any]], slo_ms: float) -> dict[str, Any]:
    """The best throughput among `steps` that sustained `slo_ms`, and whether a step the
    generator fell behind on lies above it (then the capacity may be the generator's)."""
    passing = [st for st in steps if sustained(st, slo_ms)]
    best = max(passing, key=lambda st: st["throughput"]) if passing else None
    capacity = best["throughput"] if best else 0.0
    lagged = [st for st in steps if st.get("valid") is False]
    return {
        "capacity_rps": capacity,
        "p99_ms": best["latency_all_ms"]["p99"] if best else None,
        "invalid_steps": len(lagged),
        "generator_limited": any(st["target_rate"] > capacity for st in lagged),
    }


def pool_repetition(
    by_slo: dict[str, list[dict[str, Any]]], slos: list[float]
) -> dict[str, list[dict[str, Any]]]:
    """Recompute each repetition's capacity per objective from the steps of every objective's
    bisection in that repetition (`by_slo[slo][rep]["steps"]`)."""
    reps = len(next(iter(by_slo.values())))
    out: dict[str, list[dict[str, Any]]] = {f"{slo:g}": [] for slo in slos}
    for rep in range(reps):
        steps = [st for runs in by_slo.values() for st in runs[rep]["steps"]]
        for slo in slos:
            found = by_slo[f"{slo:g}"][rep]
            out[f"{slo:g}"].append({**found, **capacity_from_steps(steps, slo)})
    return out


def check_monotone(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> None:
    """Refuse (SystemExit) a result where a capacity falls as the objective loosens."""
    for row, by_slo in runs.items():
        slos = sorted(by_slo, key=float)
        for tight, loose in zip(slos, slos[1:], strict=False):
            for rep, (a, b) in enumerate(zip(by_slo[tight], by_slo[loose], strict=True)):
                if b["capacity_rps"] < a["capacity_rps"]:
                    raise SystemExit(
                        f"{row}, repetition {rep + 1}: capacity {b['capacity_rps']:.1f}/s at "
                        f"p99 <= {loose} ms is below {a['capacity_rps']:.1f}/s at <= {tight} ms; "
                        "the result is inconsistent and is not written."
                    )


def spread(values: list[float]) -> dict[str, Any]:
    return {
        "median": float(np.median(values)),
        "min": float(min(values)),
        "max": float(max(values)),
        "runs": [float(v) for v in values],
    }


def paired_ratio(cap: dict[str, list[float]], a: str, b: str | list[str]) -> dict[str, Any] | None:
    """Per-repetition ratio of row `a` to row `b` (or to the best of rows `b` in that
    repetition), as median [min .. max]; None where a row is missing or a denominator is 0."""
    names = [b] if isinstance(b, str) else [n for n in b if n in cap]
    if a not in cap or not names or any(n not in cap for n in names):
        return None
    denominators = [max(cap[n][i] for n in names) for i in range(len(cap[a]))]
    if min(denominators) <= 0:
        return None
    return spread([x / d for x, d in zip(cap[a], denominators, strict=True)])


def ratios(cap: dict[str, list[float]]) -> dict[str, Any]:
    """The ratios the report and the goals use, each per repetition with its spread."""
    peers = [p for p in PEERS if p in cap]
    out: dict[str, Any] = {
        "batched_vs_bs1": paired_ratio(cap, "hpcml-batched", "hpcml-bs1"),
        "batched_vs_bs1_binary": paired_ratio(cap, "hpcml-batched binary", "hpcml-bs1 binary"),
        "hpcml_vs_best_peer": paired_ratio(cap, "hpcml-batched", peers) if peers else None,
        "hpcml_binary_vs_best_peer": (
            paired_ratio(cap, "hpcml-batched binary", peers) if peers else None
        ),
        "binary_vs_json_batched": paired_ratio(cap, "hpcml-batched binary", "hpcml-batched"),
        "binary_vs_json_bs1": paired_ratio(cap, "hpcml-bs1 binary", "hpcml-bs1"),
    }
    for peer in peers:
        out[f"hpcml_vs_{peer}"] = paired_ratio(cap, "hpcml-batched", peer)
    return out


def summarize(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Capacity per (row, objective) as median [min .. max], steps the generator fell behind
    on, and the ratios per repetition with their spread (serving_integrity)."""
    out: dict[str, Any] = {}
    slos = next(iter(runs.values())).keys() if runs else []
    for slo in slos:
        values = {row: [r["capacity_rps"] for r in by[slo]] for row, by in runs.items()}
        out[slo] = {
            "capacity_rps": {row: spread(v) for row, v in values.items()},
            "invalid_steps": {
                row: sum(r["invalid_steps"] for r in by[slo]) for row, by in runs.items()
            },
            "generator_limited": [
                row for row, by in runs.items() if any(r["generator_limited"] for r in by[slo])
            ],
            "ratios": ratios(values),
        }
    return out


def goals(summary: dict[str, Any], raw_forward_sps: list[float] | None) -> dict[str, Any]:
    """Issue 31's goals, each with the measured median ratio and whether it is met."""
    out: dict[str, Any] = {}

    def put(name: str, ratio: dict[str, Any] | None, goal: float) -> None:
        if ratio is not None:
            out[name] = {"median": ratio["median"], "goal": goal, "met": ratio["median"] >= goal}

    for slo, by in summary.items():
        put(
            f"p99<={slo}ms json vs best peer", by["ratios"]["hpcml_vs_best_peer"], GOAL_VS_BEST_PEER
        )
        put(
            f"p99<={slo}ms binary vs best peer",
            by["ratios"]["hpcml_binary_vs_best_peer"],
            GOAL_VS_BEST_PEER,
        )
        put(f"p99<={slo}ms json batching", by["ratios"]["batched_vs_bs1"], GOAL_BATCHING)
        put(f"p99<={slo}ms binary batching", by["ratios"]["batched_vs_bs1_binary"], GOAL_BATCHING)
        if raw_forward_sps:
            for row in ("hpcml-batched", "hpcml-batched binary"):
                values = by["capacity_rps"].get(row, {}).get("runs")
                if values:
                    r = spread([v / raw for v, raw in zip(values, raw_forward_sps, strict=True)])
                    by.setdefault("vs_raw_forward", {})[row] = r
                    put(f"p99<={slo}ms {row} vs raw batched forward", r, GOAL_VS_RAW)
    return out


def _ratio_text(r: dict[str, Any]) -> str:
    return f"{r['median']:.2f}x [{r['min']:.2f} .. {r['max']:.2f}]"


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"Capacity (req/s) at a p99 objective, bisection to within "
        f"{report['tolerance']:.0%}, {report['repeats']} repeats, {report['step_s']:g} s per "
        f"rate; median [min .. max]. {report['encoding']}. A step whose client send lag p99 "
        f"exceeded {report['integrity']['max_send_lag_ms']:g} ms is invalid (never a pass). "
        "Ratios are per repetition: median [min .. max].",
        "",
    ]
    if report.get("note"):
        lines += [f"Note: {report['note']}", ""]
    raw = report.get("raw_forward")
    if raw:
        batch = next(k for k in raw if k.startswith("batch_") and k != "batch_1")
        lines += [
            f"Raw forward, one thread: {raw[batch]['median']:.0f} samples/s at "
            f"{batch.replace('_', ' ')}, {raw['batch_1']['median']:.0f} at batch 1.",
            "",
        ]
    for slo, by in report["summary"].items():
        lines += [
            f"p99 <= {slo} ms",
            "",
            "| server | capacity | invalid steps |",
            "|---|---:|---:|",
        ]
        for kind, c in by["capacity_rps"].items():
            mark = " (generator-limited)" if kind in by["generator_limited"] else ""
            lines.append(
                f"| {kind} | {c['median']:.0f} [{c['min']:.0f} .. {c['max']:.0f}]{mark} | "
                f"{by['invalid_steps'][kind]} |"
            )
        lines.append("")
        for key, r in by["ratios"].items():
            if r is not None:
                lines.append(f"{key}: {_ratio_text(r)}  ")
        for row, r in by.get("vs_raw_forward", {}).items():
            lines.append(f"{row} / raw batched forward: {_ratio_text(r)}  ")
        lines.append("")
    lines += ["| goal | median | met |", "|---|---:|---|"]
    for name, g in report["goals"].items():
        lines.append(
            f"| {name} >= {g['goal']:g}x | {g['median']:.2f}x | {'yes' if g['met'] else 'no'} |"
        )
    lines.append("")
    for kind, info in report["peers"].items():
        versions = ", ".join(f"{k} {v}" for k, v in info["versions"].items() if v)
        lines.append(f"{kind}: {versions}; options {info['options']}; JSON {info['json']}  ")
    for kind, why in report["skipped"].items():
        lines.append(f"skipped {kind}: {why}")
    return "\n".join(lines) + "\n"


def recheck(report: dict[str, Any], max_send_lag_ms: float) -> dict[str, Any]:
    """A result written before these checks, put through them: steps whose send lag p99
    exceeded `max_send_lag_ms` become invalid, capacities are pooled per repetition and
    checked for monotony, ratios taken per repetition. Nothing is measured again."""
    runs = copy.deepcopy(report["runs"])
    slos = [float(s) for s in report["objectives_p99_ms"]]
    for by_slo in runs.values():
        for reps in by_slo.values():
            for found in reps:
                for st in found["steps"]:
                    st.setdefault("valid", st.get("send_lag_ms_p99", 0.0) <= max_send_lag_ms)
    runs = {row: pool_repetition(by, slos) for row, by in runs.items()}
    check_monotone(runs)
    summary = summarize(runs)
    return {
        **{k: v for k, v in report.items() if k not in ("summary", "runs")},
        "note": ((report.get("note") or "") + " Rechecked").strip()
        + " by benchmarks/serving_integrity.py from the recorded steps (nothing "
        "measured again); in this run the peers parsed JSON with the standard library and "
        "their versions and options were not recorded.",
        "peers": report.get("peers", {}),
        "integrity": {"max_send_lag_ms": max_send_lag_ms, "rechecked_from": "recorded steps"},
        "raw_forward": report.get("raw_forward"),
        "goals": goals(summary, None),
        "summary": summary,
        "runs": runs,
    }


def main() -> None:
    import argparse
    import json
    from pathlib import Path

    p = argparse.ArgumentParser(description="Put a serving result through the integrity checks.")
    p.add_argument("result", type=Path, help="A benchmarks/results/serving*.json file.")
    p.add_argument("--max-send-lag-ms", type=float, default=10.0)
    args = p.parse_args()
    report = recheck(json.loads(args.result.read_text()), args.max_send_lag_ms)
    out = args.result.with_name(args.result.stem + "_checked")
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
