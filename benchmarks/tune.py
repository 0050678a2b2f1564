"""ASHA + TPE against random search without pruning, on the digits demo
(examples/tune_digits.yaml): the same number of trials of the same length each (an equal
budget of training steps offered), through the real `hpcml tune`, one worker. Per arm and seed:
the best validation accuracy reached, the wall time and CPU seconds of the whole tune, the
training steps the trials actually ran (a pruned trial stops early), and where the trials' wall
time went; then the median and the spread (min to max) over the seeds. The arms alternate
within each seed, so a change in the machine's load hits both.

    python benchmarks/tune.py [--trials 9] [--steps 60] [--seeds 0 1 2] [--startup 3]

`--startup N` first measures what starting one trial costs, N alternating rounds of a 1-step
trial started both ways hpcml.tune can: a fresh interpreter under the guard (`cold`) and forked
from a warm launcher that imported torch and the trainer once (`warm`, what `hpcml tune` does).

Writes benchmarks/results/tune.json and .md (`--name` changes the file names).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CONFIG = ROOT / "examples" / "tune_digits.yaml"
ARMS = {"asha+tpe": ("tpe", "asha"), "random, no pruning": ("random", "none")}


def children_cpu_s() -> float:
    """CPU seconds of every child waited for (the tuner, and through it its launcher, guards
    and runs: each waits for its own)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def phases(run: Path, start: float, end: float) -> dict[str, float]:
    """Where one trial's wall time went, from its run.jsonl: `start` (trial start to the first
    step, less that step: imports, data, model), `steps` (the steps' own time), `between` (the
    gaps between steps: evaluations, log records) and `end` (after the last step: the last
    evaluation, export, summary, exit)."""
    steps = []
    for line in (run / "run.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "step":
            steps.append((float(rec["time"]), float(rec["step_time_s"]), int(rec["step"])))
    if not steps:
        return {"start": end - start, "steps": 0.0, "between": 0.0, "end": 0.0, "n": 0}
    train = sum(s for _, s, _ in steps)
    first = steps[0][0] - steps[0][1] - start
    span = steps[-1][0] - steps[0][0] + steps[0][1]
    return {"start": first, "steps": train, "between": span - train,
            "end": end - steps[-1][0], "n": steps[-1][2]}  # fmt: skip


def study_phases(out: Path, name: str) -> list[dict[str, Any]]:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    storage = JournalStorage(JournalFileBackend(str(out / "study.journal")))
    study = optuna.load_study(study_name=name, storage=storage)
    rows = []
    for t in study.get_trials(deepcopy=False):
        assert t.datetime_start is not None and t.datetime_complete is not None
        start, end = t.datetime_start.timestamp(), t.datetime_complete.timestamp()
        row = phases(Path(t.user_attrs["run_dir"]), start, end)
        rows.append({"trial": t.number, "state": t.state.name.lower(), **row})
    return rows


def tune(sampler: str, pruner: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="hpcml-bench-tune-") as tmp:
        out = Path(tmp) / "study"
        cmd = [
            sys.executable, "-m", "hpcml", "tune", str(CONFIG), f"tune.sampler={sampler}",
            f"tune.pruner={pruner}", f"tune.seed={seed}", f"train.max_steps={args.steps}",
            "--trials", str(args.trials), "--out", str(out), "--json",
        ]  # fmt: skip
        load = os.getloadavg()[0]
        with open(Path(tmp) / "out", "w+") as so, open(Path(tmp) / "err", "w+") as se:
            start = time.perf_counter()
            proc = subprocess.Popen(cmd, stdout=so, stderr=se, cwd=ROOT, env=env(args))
            # wait4: this tune's own CPU (its launcher, guards and runs are waited for in
            # turn), also when seeds run side by side in threads of this process
            _, status, usage = os.wait4(proc.pid, 0)
            wall, cpu = time.perf_counter() - start, usage.ru_utime + usage.ru_stime
            so.seek(0)
            se.seek(0)
            stdout, stderr = so.read(), se.read()
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{stderr[-3000:]}")
        result = json.loads(stdout.splitlines()[-1])
        trials = study_phases(out, result["study"])
    return {
        "seed": seed,
        "best_val_accuracy": result["best_value"],
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "steps_trained": sum(t["n"] for t in trials),
        "trials": result["trials"],
        "load_average_before": round(load, 2),
        "trial_phases_s": {
            k: round(sum(t[k] for t in trials), 2) for k in ("start", "steps", "between", "end")
        },  # fmt: skip
        "per_trial": trials,
    }


def env(args: argparse.Namespace) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(args.threads)}


def startup(rounds: int, args: argparse.Namespace) -> dict[str, Any]:
    """A 1-step trial (one evaluation) started cold and warm, alternating; each warm round
    uses a launcher of its own, whose import is reported apart (once per tune worker)."""
    code = r"""
import json, sys, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from hpcml.tune import trial
from hpcml.config import load_config
from hpcml.tune.launcher import Launcher, preload_for
mode, out = sys.argv[1], Path(sys.argv[2])
t0 = time.perf_counter()
warm = mode in ("warm", "preload")
launcher = Launcher(preload_for(load_config(Path(sys.argv[3]), []))) if warm else None
while launcher is not None and not launcher.ready:
    launcher.pump(1.0)
ready = time.perf_counter() - t0
if mode in ("cold", "warm"):
    cmd = trial.train_command(Path(sys.argv[3]), ["train.max_steps=1", "train.eval_every=1"],
                              out, 1)
    start = time.time()
    outcome = trial.run(cmd, out, "val_accuracy", lambda p: False, launcher=launcher)
    assert outcome.state == "complete", outcome
    print(json.dumps({"ready_s": ready, "trial_s": time.time() - start, "start": start}))
else:
    print(json.dumps({"ready_s": ready}))
if launcher is not None:
    launcher.close()
"""
    modes = ("cold", "warm", "preload", "none")
    rows: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for _ in range(rounds):
        for mode in rows:
            with tempfile.TemporaryDirectory(prefix="hpcml-bench-start-") as tmp:
                run = Path(tmp) / "run"
                load = os.getloadavg()[0]
                cpu = children_cpu_s()
                proc = subprocess.run(
                    [sys.executable, "-c", code, mode, str(run), str(CONFIG)],
                    capture_output=True, text=True, cwd=ROOT, env=env(args), check=True,
                )  # fmt: skip
                row = json.loads(proc.stdout.splitlines()[-1])
                row["cpu_s"] = children_cpu_s() - cpu
                row["load_average_before"] = load
                if mode in ("cold", "warm"):
                    start = row.pop("start")
                    row.update(phases(run, start, start + row["trial_s"]))
                rows[mode].append(row)
                print("startup", mode, row, flush=True)
    keys = ("cpu_s", "ready_s", "trial_s", "start")
    summary = {m: {k: spread([r[k] for r in rs]) for k in keys if k in rs[0]}
               for m, rs in rows.items()}  # fmt: skip
    # A trial's own CPU: its round's less the median of what the measuring process (none)
    # and a launcher (preload) cost without a trial.
    for mode, base in (("cold", "none"), ("warm", "preload")):
        less = summary[base]["cpu_s"]["median"]
        summary[f"{mode} trial alone"] = {"cpu_s": spread([r["cpu_s"] - less for r in rows[mode]])}
    return {"rounds": rows, "summary": summary}


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=9)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    p.add_argument("--side-by-side", action="store_true", help="run the seeds at the same time")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every process")
    p.add_argument("--startup", type=int, default=0, help="rounds of the start-up measurement")
    p.add_argument("--name", default="tune", help="results file name (without extension)")
    args = p.parse_args()
    out: dict[str, Any] = {
        "what": "hpcml tune on examples/tune_digits.yaml: ASHA + TPE vs random search without "
        "pruning, equal trials and steps per trial, one worker",
        "command": "python benchmarks/tune.py " + " ".join(sys.argv[1:]),
        "trials": args.trials, "max_steps": args.steps, "omp_num_threads": args.threads,
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
    }  # fmt: skip
    if args.startup:
        out["startup"] = startup(args.startup, args)
    if not args.seeds:
        return write(out, args.name)
    runs = run_seeds(args)
    keys = ("best_val_accuracy", "wall_s", "cpu_s", "steps_trained", "load_average_before")
    summary = {
        arm: {key: spread([float(r[key]) for r in rs]) for key in keys} for arm, rs in runs.items()
    }
    ratios = {
        key: spread([a[key] / r[key] for a, r in zip(*runs.values(), strict=True)])
        for key in ("wall_s", "cpu_s", "steps_trained")
    }
    out.update(runs=runs, summary=summary, ratio_per_seed=ratios,
               load_average_at_end=os.getloadavg())  # fmt: skip
    write(out, args.name)


def run_seeds(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """Each seed's two tunes, one after the other, the first arm alternating between seeds
    (a change in the machine's load hits both arms); with --side-by-side the seeds run at
    the same time, so about as many tunes of each arm run at any moment."""
    runs: dict[str, list[dict[str, Any]]] = {arm: [{}] * len(args.seeds) for arm in ARMS}

    def one_seed(i: int) -> None:
        arms = list(ARMS.items())
        for arm, (sampler, pruner) in arms if i % 2 == 0 else arms[::-1]:
            runs[arm][i] = tune(sampler, pruner, args.seeds[i], args)
            print(arm, {k: v for k, v in runs[arm][i].items() if k != "per_trial"}, flush=True)

    with ThreadPoolExecutor(len(args.seeds) if args.side_by_side else 1) as pool:
        list(pool.map(one_seed, range(len(args.seeds))))
    return runs


def write(out: dict[str, Any], name: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(out, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(markdown(out))
    print(markdown(out))


def cell(s: dict[str, float]) -> str:
    return f"{s['median']:.4g} ({s['min']:.4g} to {s['max']:.4g})"


def markdown(out: dict[str, Any]) -> str:
    lines = ["# hpcml tune: ASHA + TPE vs random search without pruning", ""]
    if "runs" in out:
        lines += tune_lines(out)
    if "startup" in out:
        lines += startup_lines(out)
    return "\n".join(lines) + "\n"


def tune_lines(out: dict[str, Any]) -> list[str]:
    lines = [
        f"`{out['command']}`: {out['trials']} trials of at most {out['max_steps']} steps per arm "
        f"and seed, one worker, OMP_NUM_THREADS={out['omp_num_threads']}; median (min to max) "
        f"over the seeds. Machine: {out['machine']['cpu_count']} cores; load average (1 min) "
        "before each tune in the last column.",
        "",
        "| arm | best val_accuracy | wall time (s) | CPU (s) | steps trained | load average |",
        "|---|---|---|---|---|---|",
    ]
    keys = ("best_val_accuracy", "wall_s", "cpu_s", "steps_trained", "load_average_before")
    for arm, s in out["summary"].items():
        lines.append(f"| {arm} | " + " | ".join(cell(s[k]) for k in keys) + " |")
    r = out["ratio_per_seed"]
    lines += [
        "",
        f"ASHA + TPE / random, per seed: wall time {cell(r['wall_s'])}, CPU {cell(r['cpu_s'])}, "
        f"steps trained {cell(r['steps_trained'])}.",
        "",
        "Where the trials' wall time went (s, summed over a tune's trials, median over seeds): "
        "start = trial start to its first step; steps = the steps' own time; between = "
        "evaluations and records between steps; end = after the last step (last evaluation, "
        "export, summary, exit).",
        "",
        "| arm | start | steps | between | end |",
        "|---|---|---|---|---|",
    ]
    for arm, rs in out["runs"].items():
        med = {k: statistics.median(x["trial_phases_s"][k] for x in rs)
               for k in ("start", "steps", "between", "end")}  # fmt: skip
        lines.append(f"| {arm} | " + " | ".join(f"{v:.1f}" for v in med.values()) + " |")
    return lines


def startup_lines(out: dict[str, Any]) -> list[str]:
    s = out["startup"]["summary"]
    lines = [
        "",
        "Starting one trial (a 1-step trial with one evaluation; median (min to max)): "
        "cold = a fresh `python -m hpcml train` under the guard, warm = forked from the "
        "launcher; preload = the launcher's own start, once per tune worker; none = the "
        "measuring process alone. CPU is the whole measuring process's; the `trial alone` rows "
        "take away the median of none (cold) or preload (warm).",
        "",
        "| start | CPU (s) | launcher ready (s) | trial wall (s) | to first step (s) |",
        "|---|---|---|---|---|",
    ]
    for mode, m in s.items():
        cells = [cell(m[k]) if k in m else "" for k in ("cpu_s", "ready_s", "trial_s", "start")]
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    return lines


if __name__ == "__main__":
    main()
