"""ASHA + TPE against random search without pruning, on the digits demo
(examples/tune_digits.yaml), through the real `hpcml tune`, one worker per tune, at an equal
budget of training steps.

The budget: both arms get the same `tune.step_budget`, B = `--budget-trials` full trials of
`--steps` steps (540 = 9 x 60 by default). Random search spends it on exactly B / steps
trials, each evaluated once, at its end (it needs no evaluation before). ASHA + TPE spends it
on as many trials as fit (a pruned trial gives back the steps it did not run; a trial starts
only if a full run still fits, so it never spends more than B), evaluated every 10 steps for
its pruner.

Per seed it records each arm's best validation accuracy, wall time, CPU seconds and steps,
and the anytime trace (after each trial: time since the tune started, steps so far, best so
far). The goal's question: does ASHA + TPE reach the same best accuracy as random search
(within one binomial standard error of random's best on the validation set: a smaller
difference is below what that set can resolve) in <= 0.5x random search's time? Answered
per seed from the trace: ASHA + TPE's time to reach it over random's time to finish its
search (its last trial's end), and ASHA + TPE's best after half of random's time and after
half the budget's steps (the latter free of the machine's load). Then the median and the
spread (min to max) over the seeds. With --side-by-side every tune (both arms of every seed)
runs at once, so a change in the machine's load hits both arms alike.

    python benchmarks/tune.py [--budget-trials 9] [--steps 60] [--seeds 0 1 2] [--side-by-side]

`--startup N` first measures what starting one trial costs, N alternating rounds of a 1-step
trial started both ways hpcml.tune can: a fresh interpreter under the guard (`cold`) and forked
from a warm launcher that imported torch and the trainer once (`warm`, what `hpcml tune` does).

Writes benchmarks/results/tune.json and .md (`--name` changes the file names).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CONFIG = ROOT / "examples" / "tune_digits.yaml"
ASHA, RANDOM = "asha+tpe", "random, no pruning"
ARMS = (ASHA, RANDOM)


def arm_overrides(arm: str, steps: int) -> list[str]:
    """What each arm changes in the example (whose tune section is the ASHA + TPE search)."""
    if arm == ASHA:
        return ["tune.sampler=tpe", "tune.pruner=asha"]
    return ["tune.sampler=random", "tune.pruner=none", f"train.eval_every={steps}"]


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


def study_trials(out: Path, name: str) -> list[dict[str, Any]]:
    """Each trial in the order it ended: state, value, end time, steps and phases."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    storage = JournalStorage(JournalFileBackend(str(out / "study.journal")))
    study = optuna.load_study(study_name=name, storage=storage)
    rows = []
    for t in study.get_trials(deepcopy=False):
        assert t.datetime_start is not None and t.datetime_complete is not None
        start, end = t.datetime_start.timestamp(), t.datetime_complete.timestamp()
        run = Path(t.user_attrs["run_dir"])
        row = phases(run, start, end)
        rows.append({"trial": t.number, "state": t.state.name.lower(), "value": t.value,
                     "params": t.params, "ended_at": end, **row})  # fmt: skip
    return sorted(rows, key=lambda r: r["ended_at"])


def val_samples(out: Path) -> int:
    """The validation set's size, from a complete trial's summary."""
    for summary in sorted(out.glob("trials/*/summary.json")):
        data = json.loads(summary.read_text())
        if data.get("status") == "finished":
            return int(data["data"]["val_samples"])
    raise SystemExit(f"no trial in {out} finished")


def trace(trials: list[dict[str, Any]], started: float) -> list[dict[str, Any]]:
    """After each trial: seconds since the tune started, steps so far, best value so far."""
    out, steps, best = [], 0, None
    for t in trials:
        steps += t["n"]
        if t["state"] == "complete" and (best is None or t["value"] > best):
            best = t["value"]
        out.append({"t_s": round(t["ended_at"] - started, 2), "steps": steps, "best": best})
    return out


def tune(arm: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    budget = args.budget_trials * args.steps
    with tempfile.TemporaryDirectory(prefix="hpcml-bench-tune-") as tmp:
        out = Path(tmp) / "study"
        cmd = [
            sys.executable, "-m", "hpcml", "tune", str(CONFIG), *arm_overrides(arm, args.steps),
            f"tune.seed={seed}", f"train.max_steps={args.steps}", f"tune.step_budget={budget}",
            "--trials", str(budget), "--out", str(out), "--json",  # the budget ends it first
        ]  # fmt: skip
        load = os.getloadavg()[0]
        with open(Path(tmp) / "out", "w+") as so, open(Path(tmp) / "err", "w+") as se:
            started, start = time.time(), time.perf_counter()
            proc = subprocess.Popen(cmd, stdout=so, stderr=se, cwd=ROOT, env=env(args))
            # wait4: this tune's own CPU (its launcher, guards and runs are waited for in
            # turn), also when tunes run side by side in threads of this process
            _, status, usage = os.wait4(proc.pid, 0)
            wall, cpu = time.perf_counter() - start, usage.ru_utime + usage.ru_stime
            so.seek(0)
            se.seek(0)
            stdout, stderr = so.read(), se.read()
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{stderr[-3000:]}")
        result = json.loads(stdout.splitlines()[-1])
        trials = study_trials(out, result["study"])
        n_val = val_samples(out)
    return {
        "seed": seed,
        "best_val_accuracy": result["best_value"],
        "best_params": result["best_params"],
        "val_samples": n_val,
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "steps_trained": sum(t["n"] for t in trials),
        "trials": result["trials"],
        "load_average_before": round(load, 2),
        "trial_phases_s": {
            k: round(sum(t[k] for t in trials), 2) for k in ("start", "steps", "between", "end")
        },  # fmt: skip
        "trace": trace(trials, started),
        "per_trial": [{k: v for k, v in t.items() if k != "ended_at"} for t in trials],
    }


def same_within(best: float, n: int) -> float:
    """One binomial standard error of an accuracy `best` measured on `n` samples."""
    return math.sqrt(best * (1 - best) / n)


def compare(asha: dict[str, Any], rnd: dict[str, Any], budget: int) -> dict[str, Any]:
    """One seed: is random search's best reached by ASHA + TPE, and how soon."""
    target = rnd["best_val_accuracy"]
    tol = same_within(target, rnd["val_samples"])
    random_end = rnd["trace"][-1]["t_s"]  # its search's end: its last trial's

    def reached(tolerance: float) -> dict[str, Any] | None:
        points = (p for p in asha["trace"] if p["best"] is not None)
        return next((p for p in points if p["best"] >= target - tolerance), None)

    hit, strict = reached(tol), reached(0.0)

    def best_by(key: str, limit: float) -> float | None:
        values = [p["best"] for p in asha["trace"] if p[key] <= limit and p["best"] is not None]
        return max(values) if values else None

    half_time, half_steps = best_by("t_s", random_end / 2), best_by("steps", budget / 2)
    return {
        "seed": rnd["seed"],
        "random_best": target,
        "asha_best_at_budget": asha["best_val_accuracy"],
        "same_within": round(tol, 4),
        "same_at_budget": asha["best_val_accuracy"] >= target - tol,
        "difference_in_samples": round(
            (asha["best_val_accuracy"] - target) * rnd["val_samples"]
        ),  # fmt: skip
        "random_search_s": random_end,
        "asha_to_random_best_s": hit["t_s"] if hit else None,
        "time_ratio": round(hit["t_s"] / random_end, 4) if hit else None,
        "steps_ratio": round(hit["steps"] / budget, 4) if hit else None,
        "asha_best_at_half_time": half_time,
        "asha_best_at_half_steps": half_steps,
        "goal_met": hit is not None and hit["t_s"] <= random_end / 2,
        "goal_met_without_tolerance": strict is not None and strict["t_s"] <= random_end / 2,
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


def ratio_spread(values: list[float | None]) -> dict[str, Any]:
    """The spread of per-seed ratios; with a seed that never got there (None), the values as
    they are (a median over the others would flatter)."""
    if any(v is None for v in values):
        return {"per_seed": values}
    return spread([float(v) for v in values if v is not None])


def cell_or_list(s: dict[str, Any]) -> str:
    if "per_seed" in s:
        return ", ".join("not reached" if v is None else f"{v:.4g}" for v in s["per_seed"])
    return cell(s)


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget-trials", type=int, default=9, help="B = this many full trials")
    p.add_argument("--steps", type=int, default=60, help="train.max_steps of a trial")
    p.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    p.add_argument("--side-by-side", action="store_true", help="run every tune at once")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every process")
    p.add_argument("--startup", type=int, default=0, help="rounds of the start-up measurement")
    p.add_argument("--name", default="tune", help="results file name (without extension)")
    args = p.parse_args()
    budget = args.budget_trials * args.steps
    out: dict[str, Any] = {
        "what": "hpcml tune on examples/tune_digits.yaml: ASHA + TPE vs random search without "
        "pruning at an equal budget of training steps, one worker per tune",
        "command": "python benchmarks/tune.py " + " ".join(sys.argv[1:]),
        "step_budget": budget, "max_steps": args.steps, "omp_num_threads": args.threads,
        "arm_overrides": {arm: arm_overrides(arm, args.steps) for arm in ARMS},
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
    }  # fmt: skip
    if args.startup:
        out["startup"] = startup(args.startup, args)
    if not args.seeds:
        return write(out, args.name)
    loads: list[float] = []
    runs = run_seeds(args, loads)
    keys = ("best_val_accuracy", "wall_s", "cpu_s", "steps_trained", "load_average_before")
    summary: dict[str, Any] = {
        arm: {key: spread([float(r[key]) for r in rs]) for key in keys} for arm, rs in runs.items()
    }
    for arm, rs in runs.items():
        summary[arm]["trials_run"] = spread([float(sum(r["trials"].values())) for r in rs])
    seeds = [compare(a, r, budget) for a, r in zip(runs[ASHA], runs[RANDOM], strict=True)]
    ratios = {key: ratio_spread([s[key] for s in seeds]) for key in ("time_ratio", "steps_ratio")}
    out.update(
        per_seed=seeds, ratio=ratios, summary=summary, runs=runs,
        load_average_during=spread(loads) if loads else None,
        goal_met_seeds=sum(s["goal_met"] for s in seeds),
        goal_met_seeds_without_tolerance=sum(s["goal_met_without_tolerance"] for s in seeds),
    )  # fmt: skip
    write(out, args.name)


def run_seeds(args: argparse.Namespace, loads: list[float]) -> dict[str, list[dict[str, Any]]]:
    """Every seed's two tunes: with --side-by-side all at once (both arms of a seed see the
    same load), else one after the other, the first arm alternating between seeds. `loads`
    gets the 1-minute load average every 30 s while they run."""
    runs: dict[str, list[dict[str, Any]]] = {arm: [{}] * len(args.seeds) for arm in ARMS}
    jobs = [(i, arm) for i in range(len(args.seeds)) for arm in ARMS[:: 1 if i % 2 == 0 else -1]]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(30.0):
            loads.append(os.getloadavg()[0])

    def one(job: tuple[int, str]) -> None:
        i, arm = job
        runs[arm][i] = tune(arm, args.seeds[i], args)
        print(arm, {k: v for k, v in runs[arm][i].items() if k not in ("per_trial", "trace")},
              flush=True)  # fmt: skip

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        with ThreadPoolExecutor(len(jobs) if args.side_by_side else 1) as pool:
            list(pool.map(one, jobs))
    finally:
        stop.set()
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
    during = out["load_average_during"]
    lines = [
        f"`{out['command']}`: both arms get a budget of {out['step_budget']} training steps "
        f"(`tune.step_budget`), trials of at most {out['max_steps']} steps, one worker, "
        f"OMP_NUM_THREADS={out['omp_num_threads']}; random search evaluates each trial once, "
        "at its end. Median (min to max) over the seeds. Machine: "
        f"{out['machine']['cpu_count']} cores; load average (1 min) before each tune in the "
        "last column" + (f", {cell(during)} while they ran." if during else "."),
        "",
        "| arm | best val_accuracy | wall time (s) | CPU (s) | steps trained | trials | load |",
        "|---|---|---|---|---|---|---|",
    ]
    keys = ("best_val_accuracy", "wall_s", "cpu_s", "steps_trained", "trials_run",
            "load_average_before")  # fmt: skip
    for arm, s in out["summary"].items():
        lines.append(f"| {arm} | " + " | ".join(cell(s[k]) for k in keys) + " |")
    lines += [
        "",
        "Per seed: random search's best, and whether ASHA + TPE reached it (the same: within "
        "one binomial standard error of random's best on the validation set), when (time since "
        "its tune started over random search's time to its last trial's end; steps over the "
        "budget), and ASHA + TPE's best after half random's time and after half the budget.",
        "",
        "| seed | random best | ASHA+TPE best at budget | same within | difference (samples) "
        "| time to random's best | ratio | steps ratio | ASHA best at 0.5x time "
        "| at 0.5x steps | goal |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in out["per_seed"]:
        hit = s["asha_to_random_best_s"]
        cells = [
            s["seed"], f"{s['random_best']:.4f}", f"{s['asha_best_at_budget']:.4f}",
            f"{s['same_within']:.4f}", f"{s['difference_in_samples']:+d}",
            f"{hit:.0f} of {s['random_search_s']:.0f} s" if hit is not None else "not reached",
            s["time_ratio"], s["steps_ratio"], _acc(s["asha_best_at_half_time"]),
            _acc(s["asha_best_at_half_steps"]), "met" if s["goal_met"] else "not met",
        ]  # fmt: skip
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    r = out["ratio"]
    lines += [
        "",
        f"Time to random search's best, ASHA + TPE / random: {cell_or_list(r['time_ratio'])}; "
        f"in steps, over the budget: {cell_or_list(r['steps_ratio'])}. Goal (the same best "
        f"accuracy in <= 0.5x the wall time) met for {out['goal_met_seeds']} of {len(out['per_seed'])} seeds; with "
        "'the same' read as at least random's best (no tolerance): for "
        f"{out['goal_met_seeds_without_tolerance']}.",
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


def _acc(value: float | None) -> str:
    return "none yet" if value is None else f"{value:.4f}"


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
