"""How close are `hpcml plan`'s predictions to measured CPU runs, out of sample?

Trains every zoo model family on this machine's CPU with `hpcml train` (one process, and two
gloo processes under ddp, zero1, zero2, zero3 and, for gpt, tensor parallelism with and
without sequence parallelism), then predicts each run with the planner:

- memory per rank: model states, saved activations (measured by hpcml.train.memprobe with
  autograd's saved-tensor hooks) and their sum, the CPU peak; goal within 10%;
- step time: calibrated per hardware (an efficiency and software costs for "cpu": per call of
  each collective kind, per parameter tensor; a rank's peak following its threads) on the runs
  of the *other* models only (leave-one-model-out, a model being an architecture at one size;
  the family-out column leaves out every size of the architecture, so gpt-tiny and gpt-mid do
  not calibrate each other); every repetition of a run is given to the calibration, which fits
  their median and measures the run-to-run noise from their spread; each prediction carries
  the 90% interval of hpcml.plan.interval. Goals: the measured median inside its interval in
  >= 90% of the runs, median |predicted / measured - 1| <= 15%.

Every run is a row; nothing is dropped. Runs whose training failed are listed with their
error.

    PYTHONPATH=src python benchmarks/plan_check.py [--quick] [--out benchmarks/results]
        [--keep DIR [--reuse]]

Writes plan_check.json and plan_check.md under --out. `--models` and `--strategies` pick runs;
with `--memory-only` only those runs' memory columns are re-measured and merged into the
existing plan_check.json (a memory-only row for a run it did not have), step time untouched:

    PYTHONPATH=src python benchmarks/plan_check.py --strategies zero1 --memory-only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

STRATEGIES_2 = ["ddp", "zero1", "zero2", "zero3"]
GPT_MID = {"n_layer": 4, "d_model": 128, "n_head": 4}


def _models(corpus: Path, quick: bool) -> list[dict[str, Any]]:
    synth = "data: {{source: synthetic, synthetic_samples: 2048, synthetic_shape: [3, 32, 32], batch_size: {b}}}"
    tokens = (
        "data: {{source: tokens, path: " + str(corpus) + ", seq_len: {s}, batch_size: {b}, "
        "eval_windows: 8}}"
    )
    out = [
        {"key": "mlp", "model": "mlp", "args": {}, "data": synth.format(b=64)},
        {"key": "simple_cnn", "model": "simple_cnn", "args": {}, "data": synth.format(b=16)},
        {"key": "gpt-tiny", "model": "gpt-tiny", "args": {}, "data": tokens.format(s=64, b=8)},
    ]
    if not quick:
        out += [
            {"key": "resnet18", "model": "resnet18", "args": {}, "data": synth.format(b=8)},
            {
                "key": "gpt-mid",
                "model": "gpt-tiny",
                "args": GPT_MID,
                "data": tokens.format(s=128, b=4),
            },
        ]
    return out


def _config(spec: dict[str, Any], steps: int) -> str:
    args = json.dumps(spec["args"])
    return (
        f"model: {{name: {spec['model']}, args: {args}}}\n{spec['data']}\n"
        "optim: {name: adamw, lr: 0.001}\n"
        f"train: {{max_steps: {steps}, eval_every: 0, checkpoint_every: 0, log_every: 100}}\n"
        "precision: fp32\n"
    )


def _train(cfg: Path, run_dir: Path, world: int, overrides: list[str]) -> str | None:
    env = {**os.environ, "PYTHONPATH": str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    cmd = [sys.executable, *(launch if world > 1 else []), "-m", "hpcml", "train", str(cfg)]
    cmd += [*overrides, "--run-dir", str(run_dir), "--quiet", "--overwrite"]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        return "did not finish in 900 s"
    if proc.returncode != 0:
        return (proc.stderr.strip().splitlines() or ["failed"])[-1][:300]
    return None


def _rep_name(name: str, rep: int, repeats: int) -> str:
    return name if repeats == 1 else f"{name}-r{rep}"


def _summaries(root: Path, name: str, repeats: int) -> tuple[list[dict[str, Any]], int]:
    """Every repetition's summary and the index of the one with the median step time (an odd
    count picks a real run, so its memory figures are that run's)."""
    runs = [
        json.loads((root / _rep_name(name, r, repeats) / "summary.json").read_text())
        for r in range(repeats)
    ]
    # As plan check compares them: a step's time without its data wait.
    times = [
        float(r["throughput"]["step_time_s"]) - float(r["throughput"].get("data_wait_s") or 0.0)
        for r in runs
    ]
    order = sorted(range(repeats), key=lambda i: times[i])
    return runs, order[(repeats - 1) // 2]


def _replayed(
    old: dict[str, Any], cfg: Path, name: str, world: int, overrides: list[str]
) -> list[dict[str, Any]]:
    """--replay: summaries of the repetitions a previous result measured for run `name`, each
    with the config this script trains it with, resolved as `hpcml train` resolves it (the
    model's completed arguments, the input shape, the parameter count), the step times that
    result recorded (already without the data wait), the threads hpcml gives each rank on that
    machine (its cores split evenly), and no memory (the memory columns are that result's)."""
    from hpcml.config import load_config
    from hpcml.models.zoo import count_parameters
    from hpcml.train.validate import resolve

    row = next((r for r in old["rows"] if r["run"] == name), None)
    if row is None:
        return []
    c = load_config(cfg, overrides)
    res = resolve(c, world)
    cores = int(old["machine"]["cpus"])
    return [
        {
            "status": "finished",
            "run_dir": f"replayed/{name}-r{i}",
            "world_size": world,
            "device": {
                "type": "cpu",
                "name": "replayed",
                "count": cores,
                "threads": max(1, cores // world),
            },
            "precision": c.precision,
            "model": {
                "name": c.model.name,
                "args": res.model_args,
                "input_shape": list(res.splits.input_shape),
                "parameters": count_parameters(res.meta_model),
            },
            "memory": {},
            "throughput": {"step_time_s": t, "data_wait_s": 0.0},
            "config": c.model_dump(mode="json"),
        }
        for i, t in enumerate(row["measured_step_times_s"])
    ]


def _jobs(models: list[dict[str, Any]]) -> list[tuple[dict[str, Any], str, int, list[str]]]:
    jobs = []
    for spec in models:
        jobs.append((spec, "single", 1, []))
        for s in STRATEGIES_2:
            jobs.append((spec, s, 2, [f"parallel.strategy={s}"]))
        if spec["model"].startswith("gpt"):
            jobs.append((spec, "tp", 2, ["parallel.tp=2"]))
            jobs.append((spec, "tp+sp", 2, ["parallel.tp=2", "parallel.sequence_parallel=true"]))
    return jobs


QUANTITIES = [
    "model_states_bytes",
    "activations_bytes",
    "states_plus_activations_bytes",
    "peak_bytes",  # the busiest rank's step peak, traced by allocation as it ran (CPU)
    "step_time_s",
]
MEMORY = (
    "params_bytes",
    "grads_bytes",
    "optimizer_bytes",
    "model_states_bytes",
    "activations_bytes",
    "states_plus_activations_bytes",
    "peak_bytes",
    "peak_allocated_bytes",
)


# Notes about memory that a re-measurement makes obsolete.
STALE = ("re-measured", "ZeroRedundancyOptimizer gives each rank whole parameter tensors")


def _one_collective_cost(setups: list[Any]) -> dict[str, Any]:
    """Leave-one-model-out step time with one software cost per collective call whatever its
    kind (the calibration before per-kind costs), for comparison: label -> ratio cell."""
    from hpcml.plan.calibration import calibrate
    from hpcml.plan.check import calibration_points, model_key
    from hpcml.plan.perf import step_time

    out, fits = {}, {}
    for s in setups:
        k = model_key(s.model)
        if k not in fits:
            others = [o for o in setups if model_key(o.model) != k and o.measured_step_s]
            fits[k] = calibrate(calibration_points(others), per_kind=False) if others else None
        if fits[k] is None or not s.measured_step_s:
            continue
        pred = step_time(s.model, s.layout, s.training, s.cluster, fits[k]).step_s
        ratio = pred / s.measured_step_s
        out[s.label] = {
            "predicted": pred,
            "measured": s.measured_step_s,
            "ratio": ratio,
            "ok": abs(ratio - 1) <= 0.25,
        }
    return out


def _median_error(rows: list[dict[str, Any]], column: str) -> float | None:
    errors = [abs(r[column]["ratio"] - 1) for r in rows if (r.get(column) or {}).get("ratio")]
    return statistics.median(errors) if errors else None


def _coverage(rows: list[dict[str, Any]], column: str) -> dict[str, Any]:
    """How often the measured step time (the median of the repetitions, and each repetition)
    falls inside the printed 90% interval, the median |predicted / measured - 1|, and the
    intervals' median width (high / low)."""
    cells = [(r, r[column]) for r in rows if (r.get(column) or {}).get("interval")]
    reps = [(t, c["interval"]) for r, c in cells for t in r["measured_step_times_s"]]
    widths = [c["interval"]["high_s"] / c["interval"]["low_s"] for _, c in cells]
    return {
        "runs": len(rows),
        "runs_with_interval": len(cells),
        "inside": sum(1 for _, c in cells if c["inside"]),
        "repetitions": len(reps),
        "repetitions_inside": sum(1 for t, iv in reps if iv["low_s"] <= t <= iv["high_s"]),
        "median_abs_error": _median_error(rows, column),
        "median_interval_high_over_low": statistics.median(widths) if widths else None,
    }


def _when(path: Path) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(path.stat().st_mtime))


def _cells(rows: Any) -> dict[str, Any]:
    keep = ("predicted", "measured", "ratio", "ok", "interval", "inside")
    return {r.quantity: {k: v for k, v in r.to_dict().items() if k in keep} for r in rows}


def _markdown(result: dict[str, Any]) -> str:
    lines = [
        "| run | world | "
        + " | ".join(q.replace("_bytes", "") for q in QUANTITIES)
        + " | step 90% interval / measured | step_time_s, family out"
        " | measured step ms (no data wait), median [min .. max] |",
        "|---|---|" + "---|" * (len(QUANTITIES) + 3),
    ]
    for r in result["rows"]:
        cells = []
        for q in (*QUANTITIES, "interval", "step_time_family_out"):
            if q == "interval":
                cells.append(_interval_cell(r.get("step_time_s") or {}))
                continue
            c = r.get(q) or {}
            ratio = c.get("ratio")
            cells.append("-" if ratio is None else f"{ratio:.3f}" + ("" if c["ok"] else " miss"))
        times = sorted(1000 * t for t in r.get("measured_step_times_s") or [])
        cells.append(
            f"{times[(len(times) - 1) // 2]:.1f} [{times[0]:.1f} .. {times[-1]:.1f}]"
            if times
            else "-"
        )
        lines.append(f"| {r['run']} | {r['world']} | " + " | ".join(cells) + " |")
    for f in result["failed"]:
        lines.append(f"| {f['run']} | failed: {f['error']} |")
    lines += _coverage_lines(result.get("step_time_summary") or {})
    for b in result.get("floors") or []:
        lines += [
            "",
            f"In-sample floor of the step-time model ({b['accelerator']}, hpcml.plan.floor): "
            f"calibrated on all {b['runs']} runs at once to minimise the worst row, it still "
            f"leaves {b['worst']:.1%} ({', '.join(b['binding'])}). Each model's runs alone "
            "(no calibration, out of sample or not, does better on them):",
            "",
            "| model | runs | floor |",
            "|---|---|---|",
        ]
        lines += [
            f"| {label} | {m['runs']} | {m['worst']:.1%}{' (above the goal)' if m['worst'] > 0.25 else ''} |"
            for label, m in b["per_model"].items()
        ]
    return "\n".join(lines) + "\n"


def _interval_cell(c: dict[str, Any]) -> str:
    iv, m = c.get("interval"), c.get("measured")
    if not iv or not m:
        return "-"
    return f"{iv['low_s'] / m:.2f} .. {iv['high_s'] / m:.2f}" + ("" if c["inside"] else " OUT")


def _coverage_lines(summary: dict[str, Any]) -> list[str]:
    lines = []
    for name, c in summary.items():
        if "inside" not in c:
            lines += [
                "",
                f"Step time, {name}: median |predicted / measured - 1| "
                f"{c['median_abs_error']:.1%}.",
            ]
            continue
        lines += [
            "",
            f"Step time, {name}: the measured median inside its printed 90% interval in "
            f"{c['inside']} of {c['runs_with_interval']} runs ({c['repetitions_inside']} of "
            f"{c['repetitions']} single repetitions); median |predicted / measured - 1| "
            f"{c['median_abs_error']:.1%}; the intervals' median width (high / low) "
            f"{c['median_interval_high_over_low']:.2f}x.",
        ]
    return lines


def _write(result: dict[str, Any], out: Path) -> None:
    result["misses"] = {
        q: sum(1 for r in result["rows"] if (r.get(q) or {}).get("ok") is False)
        for q in (*QUANTITIES, "step_time_family_out")
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan_check.json").write_text(json.dumps(result, indent=1))
    (out / "plan_check.md").write_text(_markdown(result))
    print(_markdown(result))


def _merge_memory(setups: list[Any], labels: dict[str, Any], failed: list[Any], a: Any) -> None:
    """--memory-only: re-measure memory of the selected runs and put their memory columns into
    the existing results (a new row where the run had none); step time is left as it was,
    since its calibration is fitted on all the other runs of the table."""
    from hpcml.plan.check import check_run

    path = a.out / "plan_check.json"
    result = json.loads(path.read_text())
    by_run = {r["run"]: r for r in result["rows"]}
    argv = [x for i, x in enumerate(a.argv) if "--keep" not in (x, a.argv[i - 1] if i else "")]
    command = " ".join(["PYTHONPATH=src python benchmarks/plan_check.py", *argv])
    note = "memory columns re-measured by: " + command
    result.setdefault("memory_updates", []).append(
        {
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": command,
            "runs": [s.label for s in setups],
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
            "note": "memory is counted in bytes (tensors held, saved-tensor hooks), which other "
            "jobs on the machine do not change; step time is not re-measured: existing rows keep "
            "the full run's, new rows have none",
        }
    )
    for s in setups:
        key, strategy, world = labels[s.label]
        report = check_run(s)
        mem = {q: c for q, c in _cells(report.rows).items() if q in MEMORY}
        row = by_run.get(s.label)
        if row is None:
            row = {"run": s.label, "model": key, "strategy": strategy, "world": world}
            row["notes"] = [n for n in report.notes if "step time" not in n]
            row["notes"].append("memory-only row: step time not predicted out of sample")
            result["rows"].append(row)
        for q in MEMORY:
            row.pop(q, None)
        row.update(mem)
        # The old run's notes stay (its step time stays), less those about memory it replaces.
        row["notes"] = [n for n in row["notes"] if not any(x in n for x in STALE)] + [note]
    # Rows in the order a full run writes them: by model, then strategy.
    models = list(dict.fromkeys(r["model"] for r in result["rows"]))
    order = ["single", *STRATEGIES_2, "tp", "tp+sp"]
    result["rows"].sort(key=lambda r: (models.index(r["model"]), order.index(r["strategy"])))
    done = {s.label for s in setups}
    result["failed"] = [f for f in result["failed"] if f["run"] not in done] + failed
    _write(result, a.out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="mlp, simple_cnn and gpt-tiny only")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    ap.add_argument("--keep", type=Path, default=None, help="keep run folders here")
    ap.add_argument(
        "--reuse",
        action="store_true",
        help="with --keep: predict runs already in that folder instead of training them again "
        "(a change to the planner re-checked against the same measurements)",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="train every run this many times (order rotated) and predict the one with the "
        "median step time; the table lists every repetition's step time",
    )
    ap.add_argument(
        "--replay",
        type=Path,
        default=None,
        help="train nothing: predict again the step times a previous result (plan_check.json) "
        "measured, its memory columns kept (a planner change re-checked against archived "
        "measurements)",
    )
    ap.add_argument("--models", nargs="+", help="only these model keys (e.g. mlp resnet18)")
    ap.add_argument("--strategies", nargs="+", help="only these (single ddp zero1 ... tp tp+sp)")
    ap.add_argument(
        "--memory-only",
        action="store_true",
        help="update only the memory columns of these runs in the existing plan_check.json",
    )
    a = ap.parse_args()
    a.argv = sys.argv[1:]
    if a.reuse and a.keep is None:
        ap.error("--reuse needs --keep DIR, the folder holding the runs to predict again")

    from hpcml.data.sources.tokens import prepare_pystdlib
    from hpcml.plan.check import leave_one_model_out, setup_from_summary
    from hpcml.plan.floor import floors
    from hpcml.plan.hardware import load_catalog

    root = a.keep or Path(tempfile.mkdtemp(prefix="plan_check_"))
    root.mkdir(parents=True, exist_ok=True)
    corpus = root / "corpus"
    if not corpus.exists():
        prepare_pystdlib(corpus, val_fraction=0.2, max_bytes=400_000)
    catalog = load_catalog()
    setups, failed, labels = [], [], {}
    t0 = time.perf_counter()
    models = _models(corpus, a.quick and not a.models)
    jobs = [
        j
        for j in _jobs(models)
        if (not a.models or j[0]["key"] in a.models) and (not a.strategies or j[1] in a.strategies)
    ]
    errors: dict[str, str] = {}
    old = json.loads(a.replay.read_text()) if a.replay else None
    for rep in range(0 if old else a.repeats):
        # Every run once per repetition, the order rotated, so slow spells of a shared machine
        # fall on different runs in each repetition.
        shift = rep * len(jobs) // a.repeats
        for spec, strategy, world, overrides in jobs[shift:] + jobs[:shift]:
            name = f"{spec['key']}-{strategy}".replace("+", "")
            cfg = root / f"{name}.yaml"
            cfg.write_text(_config(spec, a.steps))
            folder = root / _rep_name(name, rep, a.repeats)
            reused = a.reuse and (folder / "summary.json").exists()
            err = None if reused else _train(cfg, folder, world, overrides)
            print(
                f"{folder.name}: {'reused' if reused else 'ok' if err is None else err}", flush=True
            )
            if err is not None:
                errors[name] = err
    median_label: dict[str, str] = {}
    for spec, strategy, world, overrides in jobs:
        name = f"{spec['key']}-{strategy}".replace("+", "")
        if name in errors:
            failed.append({"run": name, "error": errors[name]})
            continue
        if old is not None:
            cfg = root / f"{name}.yaml"
            cfg.write_text(_config(spec, a.steps))
            runs = _replayed(old, cfg, name, world, overrides)
            if not runs:
                failed.append({"run": name, "error": f"not in {a.replay}"})
                continue
            times = [r["throughput"]["step_time_s"] for r in runs]
            mid = sorted(range(len(runs)), key=lambda i: times[i])[(len(runs) - 1) // 2]
        else:
            runs, mid = _summaries(root, name, a.repeats)
        # Every repetition is a run of its own: a calibration fits their median and measures
        # the noise from their spread (hpcml.plan.check.calibration_points).
        for r, summary in enumerate(runs):
            label = _rep_name(name, r, len(runs))
            setups.append(setup_from_summary(summary, catalog, label))
            labels[label] = (spec["key"], strategy, world)
        median_label[name] = _rep_name(name, mid, len(runs))
    if a.memory_only:
        medians = [
            replace(s, label=n) for n, m in median_label.items() for s in setups if s.label == m
        ]
        _merge_memory(medians, {n: labels[m] for n, m in median_label.items()}, failed, a)
        return
    model_out = {r.setup.label: r for r in leave_one_model_out(setups)}
    family_out = {r.setup.label: r for r in leave_one_model_out(setups, hold_out="family")}
    one_cost = _one_collective_cost(setups)
    rows = []
    for name, label in median_label.items():
        rep = model_out[label]
        key, strategy, world = labels[label]
        times = [s.measured_step_s for s in setups if labels[s.label] == labels[label]]
        cells = _cells(rep.rows)
        if old is not None:  # memory is not replayed: that result's columns, as measured
            kept = next(r for r in old["rows"] if r["run"] == name)
            cells.update({q: kept[q] for q in MEMORY if q in kept})
        rows.append(
            {
                "run": name,
                "model": key,
                "strategy": strategy,
                "world": world,
                **cells,
                "step_time_family_out": _cells(family_out[label].rows).get("step_time_s"),
                "step_time_one_collective_cost": one_cost.get(label),
                "measured_step_times_s": times,
                "calibration": rep.calibration.to_dict(),
                "notes": list(rep.notes),
            }
        )
    if old is not None:
        stamps = old["runs_finished"]
    else:
        stamps = sorted(_when(root / label / "summary.json") for label in labels)
    result = {
        "question": "plan vs measured CPU runs; step time out of sample (leave-one-model-out)",
        "command": "PYTHONPATH=src python benchmarks/plan_check.py " + " ".join(a.argv),
        "machine": old["machine"]
        if old
        else {"platform": platform.platform(), "cpus": os.cpu_count()},
        **(
            {"replayed": f"step times and memory columns measured by: {old['command']}"}
            if old
            else {}
        ),
        "goals": {
            "memory": 0.10,
            "step_time": 0.25,
            "step_time_inside_interval": 0.90,
            "step_time_median_error": 0.15,
        },
        "wall_s": time.perf_counter() - t0,
        "runs_finished": stamps[:1] + stamps[-1:],
        "rows": rows,
        "step_time_summary": {
            "model out": _coverage(rows, "step_time_s"),
            "family out": _coverage(rows, "step_time_family_out"),
            "model out, one cost for every collective kind": {
                "median_abs_error": _median_error(rows, "step_time_one_collective_cost")
            },
        },
        "failed": failed,
        # The best any single calibration of the model could do on these runs, and on each
        # model's runs alone (hpcml.plan.floor): what the model's form allows, fit aside.
        "floors": floors(setups),
    }
    _write(result, a.out)


if __name__ == "__main__":
    main()
