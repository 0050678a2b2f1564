"""Pruned, model-guided search against random search without pruning, on the digits demo
(examples/tune_digits.yaml), through the real `hpcml tune`, one worker per tune, at an equal
budget of training samples (or steps).

Trials of 180 steps by default (`--steps`): the example's space with a trial of 180 steps,
where the pruners' first rung (20, the first evaluation after the longest warmup) is 1/9 of
a trial and the factor between rungs is 3 (rungs at 20 and 60), as in ASHA's own setting.
At the example's 60 steps (kept short for the tests) the first rung is a third of a trial,
so pruning saves at most two thirds of a bad one, and on this task the benchmark's question
there is a coin flip for any search (benchmarks/tune_replay.py; archive/tune_steps60.json).

The arms: ASHA + TPE (the example's search: 3 random start-up trials) and random search
without pruning, each trial evaluated once, at its end (it needs no evaluation before);
`--arms` adds the same search before an earlier change (`asha+tpe before`: 5 start-up trials,
a reduction factor of 3) and Hyperband + TPE. Random search's
`tune.seed` is the seed, the model-guided arms' the seed + 1000, so TPE's random start-up
trials are not random search's first points (they were once: a head start the method did
not earn); the model-guided arms share theirs, a paired comparison of them.
The budget: every arm gets the same `tune.sample_budget`, B =
`--budget-trials` trials of `--steps` steps at the example's batch of 32 (69,120 samples =
12 x 180 x 32 by default): a step of batch 64 costs twice one of 32, as it does on the machine.
A trial starts only if the largest trial (all its steps at batch 64) still fits, so no arm spends
more than B; a pruned trial gives back what it did not run. `--budget-unit steps` gives every
arm `tune.step_budget` = `--budget-trials` x `--steps` instead (the earlier benchmark).

Per seed it records each arm's best validation accuracy, wall time, CPU seconds, steps and
samples, and the anytime trace (after each trial: time since the tune started, steps and
samples so far, best so far). The goal's question, for each pruned arm: does it reach the same
best accuracy as random search (within one binomial standard error of random's best on the
validation set: a smaller difference is below what that set can resolve) in <= 0.5x random
search's time? Answered per seed from the trace: the arm's time to reach it over random's time
to finish its search (its last trial's end), and the arm's best after half of random's time
and after half the budget (the latter free of the machine's load). Then the median and the
spread (min to max) over the seeds, and, for scale, the same question asked of random search's
own trace (a seed where luck alone answers yes cannot tell a better search from luck). With
--side-by-side every tune (every arm of every seed) runs at once, so a change in the machine's
load hits every arm alike.

    python benchmarks/tune.py --seeds 0 1 2 --side-by-side  # the committed result
    python benchmarks/tune.py [--budget-trials 12] [--steps 180] [--arms ...] [--side-by-side]
    python benchmarks/tune.py --from-json benchmarks/results/tune.json  # the tables again

`--startup N` first measures what starting one trial costs, N alternating rounds of a 1-step
trial started both ways hpcml.tune can: a fresh interpreter under the guard (`cold`) and forked
from a warm launcher that imported torch and the trainer once (`warm`, what `hpcml tune` does).

Writes benchmarks/results/tune.json and .md (`--name` changes the file names); the JSON first
right after the tunes, with their raw runs, so an error in the analysis loses no measurement.
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

import yaml

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CONFIG = ROOT / "examples" / "tune_digits.yaml"
ASHA, HYPERBAND, RANDOM = "asha+tpe", "hyperband+tpe", "random, no pruning"
ASHA_BEFORE = "asha+tpe before"
ARMS = (ASHA, ASHA_BEFORE, HYPERBAND, RANDOM)
SEED_OFFSET = 1000
"""The model-guided arms' `tune.seed` is the seed plus this, random search's the seed: TPE's
random start-up trials would otherwise be random search's first points, a head start the
method did not earn. The model-guided arms share theirs (a paired comparison of them)."""
BATCH = 32
"""The example's data.batch_size, the middle of its space's choices: what a budget of N trials
is counted at in samples."""


def arm_overrides(arm: str, steps: int) -> list[str]:
    """What each arm changes in the example (whose tune section is the ASHA + TPE search)."""
    if arm == ASHA:
        return ["tune.sampler=tpe", "tune.pruner=asha"]
    if arm == ASHA_BEFORE:  # the example's search before 3 start-up trials and rungs at 20, 40
        return ["tune.sampler=tpe", "tune.pruner=asha", "tune.startup_trials=5",
                "tune.reduction_factor=3"]  # fmt: skip
    if arm == HYPERBAND:
        return ["tune.sampler=tpe", "tune.pruner=hyperband"]
    return ["tune.sampler=random", "tune.pruner=none", f"train.eval_every={steps}"]


def tune_seed(arm: str, seed: int) -> int:
    return seed if arm == RANDOM else seed + SEED_OFFSET


def budget_of(args: argparse.Namespace) -> tuple[str, int]:
    """The budget's unit (`steps` or `samples`) and size."""
    steps = args.budget_trials * args.steps
    return (args.budget_unit, steps * BATCH if args.budget_unit == "samples" else steps)


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
                     "params": t.params, "ended_at": end, **row,
                     "samples": int(t.user_attrs.get("samples", 0))})  # fmt: skip
    return sorted(rows, key=lambda r: r["ended_at"])


def val_samples(out: Path) -> int:
    """The validation set's size, from a complete trial's summary."""
    for summary in sorted(out.glob("trials/*/summary.json")):
        data = json.loads(summary.read_text())
        if data.get("status") == "finished":
            return int(data["data"]["val_samples"])
    raise SystemExit(f"no trial in {out} finished")


def trace(trials: list[dict[str, Any]], started: float) -> list[dict[str, Any]]:
    """After each trial: seconds since the tune started, steps and samples so far, best value
    so far."""
    out, steps, samples, best = [], 0, 0, None
    for t in trials:
        steps += t["n"]
        samples += t["samples"]
        if t["state"] == "complete" and (best is None or t["value"] > best):
            best = t["value"]
        out.append({"t_s": round(t["ended_at"] - started, 2), "steps": steps,
                    "samples": samples, "best": best})  # fmt: skip
    return out


def tune(arm: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    unit, budget = budget_of(args)
    key = "tune.sample_budget" if unit == "samples" else "tune.step_budget"
    with tempfile.TemporaryDirectory(prefix="hpcml-bench-tune-") as tmp:
        out = Path(tmp) / "study"
        cmd = [
            sys.executable, "-m", "hpcml", "tune", str(config_for(args, Path(tmp))),
            *arm_overrides(arm, args.steps),
            f"tune.seed={tune_seed(arm, seed)}", f"train.max_steps={args.steps}",
            f"{key}={budget}",
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
        "tune_seed": tune_seed(arm, seed),
        "best_val_accuracy": result["best_value"],
        "best_params": result["best_params"],
        "val_samples": n_val,
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "steps_trained": sum(t["n"] for t in trials),
        "samples_trained": sum(t["samples"] for t in trials),
        "trials": result["trials"],
        "load_average_before": round(load, 2),
        "trial_phases_s": {
            k: round(sum(t[k] for t in trials), 2) for k in ("start", "steps", "between", "end")
        },  # fmt: skip
        "trace": trace(trials, started),
        "per_trial": [{k: v for k, v in t.items() if k != "ended_at"} for t in trials],
    }


def config_for(args: argparse.Namespace, folder: Path) -> Path:
    """The example, or with `--lr LOW HIGH` a copy in `folder` whose space searches the learning
    rate in that range (the study's name stays the example's)."""
    if args.lr is None:
        return CONFIG
    data = yaml.safe_load(CONFIG.read_text())
    data["tune"]["space"]["optim.lr"].update(low=args.lr[0], high=args.lr[1])
    path = folder / CONFIG.name
    path.write_text(yaml.safe_dump(data))
    return path


def same_within(best: float, n: int) -> float:
    """One binomial standard error of an accuracy `best` measured on `n` samples."""
    return math.sqrt(best * (1 - best) / n)


def compare(arm: dict[str, Any], rnd: dict[str, Any], unit: str, budget: int) -> dict[str, Any]:
    """One seed: is random search's best reached by the pruned arm, and how soon."""
    target = rnd["best_val_accuracy"]
    tol = same_within(target, rnd["val_samples"])
    random_end = rnd["trace"][-1]["t_s"]  # its search's end: its last trial's

    def reached(tolerance: float) -> dict[str, Any] | None:
        points = (p for p in arm["trace"] if p["best"] is not None)
        return next((p for p in points if p["best"] >= target - tolerance), None)

    hit, strict = reached(tol), reached(0.0)

    def best_by(key: str, limit: float) -> float | None:
        values = [p["best"] for p in arm["trace"] if p[key] <= limit and p["best"] is not None]
        return max(values) if values else None

    half_time, half_budget = best_by("t_s", random_end / 2), best_by(unit, budget / 2)
    return {
        "seed": rnd["seed"],
        "random_best": target,
        "best_at_budget": arm["best_val_accuracy"],
        "same_within": round(tol, 4),
        "same_at_budget": arm["best_val_accuracy"] >= target - tol,
        "difference_in_samples": round(
            (arm["best_val_accuracy"] - target) * rnd["val_samples"]
        ),  # fmt: skip
        "random_search_s": random_end,
        "to_random_best_s": hit["t_s"] if hit else None,
        "time_ratio": round(hit["t_s"] / random_end, 4) if hit else None,
        "budget_ratio": round(hit[unit] / budget, 4) if hit else None,
        "best_at_half_time": half_time,
        "best_at_half_budget": half_budget,
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
    outcome = trial.run(cmd, out, "val_accuracy", lambda p: False, 1, launcher=launcher)
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
    p.add_argument("--budget-trials", type=int, default=12, help="B = this many trials")
    p.add_argument("--budget-unit", choices=("samples", "steps"), default="samples")
    p.add_argument("--steps", type=int, default=180, help="train.max_steps of a trial")
    p.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    p.add_argument("--lr", type=float, nargs=2, help="search the learning rate in this range")
    p.add_argument("--arms", nargs="*", choices=ARMS, default=[ASHA, RANDOM])
    p.add_argument("--side-by-side", action="store_true", help="run every tune at once")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every process")
    p.add_argument("--startup", type=int, default=0, help="rounds of the start-up measurement")
    p.add_argument("--name", default="tune", help="results file name (without extension)")
    p.add_argument("--from-json", type=Path, help="analyse this result file's runs again")
    args = p.parse_args()
    if args.from_json is not None:
        out = json.loads(args.from_json.read_text())
        return write(analyse(out), args.name)
    unit, budget = budget_of(args)
    out: dict[str, Any] = {
        "what": "hpcml tune on examples/tune_digits.yaml: pruned, model-guided search vs random "
        f"search without pruning at an equal budget of training {unit}, one worker per tune",
        "command": "python benchmarks/tune.py " + " ".join(sys.argv[1:]),
        "budget_unit": unit, "budget": budget, "max_steps": args.steps, "lr_range": args.lr,
        "omp_num_threads": args.threads,
        "arm_overrides": {arm: arm_overrides(arm, args.steps) for arm in args.arms},
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
    }  # fmt: skip
    if args.startup:
        out["startup"] = startup(args.startup, args)
    if not args.seeds:
        return write(out, args.name)
    loads: list[float] = []
    out["runs"] = run_seeds(args, loads, out)
    out["load_average_during"] = spread(loads) if loads else None
    write_json(out, args.name)  # the measurements first: the analysis below may be rerun
    write(analyse(out), args.name)


def analyse(out: dict[str, Any]) -> dict[str, Any]:
    """The summary per arm and each pruned arm against random search, from `out["runs"]`."""
    runs, unit, budget = out["runs"], out["budget_unit"], out["budget"]
    keys = ("best_val_accuracy", "wall_s", "cpu_s", "steps_trained", "samples_trained",
            "load_average_before")  # fmt: skip
    summary: dict[str, Any] = {
        arm: {key: spread([float(r[key]) for r in rs]) for key in keys} for arm, rs in runs.items()
    }
    for arm, rs in runs.items():
        summary[arm]["trials_run"] = spread([float(sum(r["trials"].values())) for r in rs])
    compared = {}
    for arm in (a for a in runs if a != RANDOM and RANDOM in runs):
        seeds = [compare(a, r, unit, budget) for a, r in zip(runs[arm], runs[RANDOM], strict=True)]
        compared[arm] = {
            "per_seed": seeds,
            "ratio": {k: ratio_spread([s[k] for s in seeds])
                      for k in ("time_ratio", "budget_ratio")},
            "goal_met_seeds": sum(s["goal_met"] for s in seeds),
            "goal_met_seeds_without_tolerance": sum(s["goal_met_without_tolerance"] for s in seeds),
        }  # fmt: skip
    return {**out, "summary": summary, "compared": compared, **random_itself(runs, unit, budget)}


def random_itself(runs: dict[str, Any], unit: str, budget: int) -> dict[str, Any]:
    """For scale: random search measured against itself, the same question asked of its own
    trace (when did it come within one standard error of its own final best?). A seed where
    random search got there in <= 0.5x its own time answers the goal's question yes without
    any better method: on such a seed the benchmark cannot tell a better search from luck."""
    if RANDOM not in runs:
        return {}
    seeds = [compare(r, r, unit, budget) for r in runs[RANDOM]]
    return {
        "random_itself": {
            "time_ratio": [s["time_ratio"] for s in seeds],
            "budget_ratio": [s["budget_ratio"] for s in seeds],
            "at_most_half": sum(s["goal_met"] for s in seeds),
        }
    }


def run_seeds(
    args: argparse.Namespace, loads: list[float], partial: dict[str, Any]
) -> dict[str, list[dict[str, Any]]]:
    """Every seed's tunes: with --side-by-side all at once (every arm of a seed sees the
    same load), else one after the other, the arms' order turning between seeds. `loads`
    gets the 1-minute load average every 30 s while they run; `partial` (with the runs so
    far) is written to the results file as each tune ends."""
    arms = tuple(args.arms)
    runs: dict[str, list[dict[str, Any]]] = {arm: [{}] * len(args.seeds) for arm in arms}
    jobs = [(i, arm) for i in range(len(args.seeds)) for arm in arms[:: 1 if i % 2 == 0 else -1]]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(30.0):
            loads.append(os.getloadavg()[0])

    lock = threading.Lock()

    def one(job: tuple[int, str]) -> None:
        i, arm = job
        result = tune(arm, args.seeds[i], args)
        with lock:
            runs[arm][i] = result
            write_json({**partial, "runs": runs, "partial": True}, args.name)
        print(arm, {k: v for k, v in result.items() if k not in ("per_trial", "trace")},
              flush=True)  # fmt: skip

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        with ThreadPoolExecutor(len(jobs) if args.side_by_side else 1) as pool:
            list(pool.map(one, jobs))
    finally:
        stop.set()
    return runs


def write_json(out: dict[str, Any], name: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(out, indent=2) + "\n")


def write(out: dict[str, Any], name: str) -> None:
    write_json(out, name)
    (RESULTS / f"{name}.md").write_text(markdown(out))
    print(markdown(out))


def cell(s: dict[str, float]) -> str:
    f = ".0f" if abs(s["max"]) >= 1e4 else ".4g"  # samples: whole numbers, not 1.68e+04
    return f"{s['median']:{f}} ({s['min']:{f}} to {s['max']:{f}})"


def markdown(out: dict[str, Any]) -> str:
    lines = ["# hpcml tune: pruned, model-guided search vs random search without pruning", ""]
    if "summary" in out:
        lines += tune_lines(out)
    if "startup" in out:
        lines += startup_lines(out)
    if "note" in out:
        lines += ["", out["note"]]
    return "\n".join(lines) + "\n"


def tune_lines(out: dict[str, Any]) -> list[str]:
    during, unit = out["load_average_during"], out["budget_unit"]
    lines = [
        f"`{out['command']}`: every arm gets a budget of {out['budget']} training {unit} "
        f"(`tune.{unit[:-1]}_budget`), trials of at most {out['max_steps']} steps, "
        + (f"the learning rate searched in {lr[0]:g} to {lr[1]:g}, " if (lr := out.get("lr_range"))
           else "the example's space, ")
        + "one worker, "
        f"OMP_NUM_THREADS={out['omp_num_threads']}; random search evaluates each trial once, "
        "at its end. Random search's `tune.seed` is the seed, the model-guided arms' the seed + "
        f"{SEED_OFFSET} (no shared start-up points). Median (min to max) over the seeds. Machine: "
        f"{out['machine']['cpu_count']} cores; load average (1 min) before each tune in the "
        "last column" + (f", {cell(during)} while they ran." if during else "."),
        "",
        "| arm | best val_accuracy | wall time (s) | CPU (s) | steps trained | samples trained "
        "| trials | load |",
        "|---|---|---|---|---|---|---|---|",
    ]
    keys = ("best_val_accuracy", "wall_s", "cpu_s", "steps_trained", "samples_trained",
            "trials_run", "load_average_before")  # fmt: skip
    for arm, s in out["summary"].items():
        lines.append(f"| {arm} | " + " | ".join(cell(s[k]) for k in keys) + " |")
    for arm, c in out["compared"].items():
        lines += compared_lines(arm, c, unit)
    if "random_itself" in out:
        r = out["random_itself"]
        lines += [
            "",
            "For scale, random search against itself: it came within one standard error of its "
            f"own final best at {', '.join(str(t) for t in r['time_ratio'])} of its time ("
            f"{unit}: {', '.join(str(t) for t in r['budget_ratio'])}), <= 0.5x on "
            f"{r['at_most_half']} of {len(r['time_ratio'])} seeds: a seed where it did answers "
            "the goal's question yes with no better method than luck.",
        ]
    lines += [
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


def compared_lines(arm: str, c: dict[str, Any], unit: str) -> list[str]:
    lines = [
        "",
        f"{arm} per seed: random search's best, and whether {arm} reached it (the same: within "
        "one binomial standard error of random's best on the validation set), when (time since "
        "its tune started over random search's time to its last trial's end; "
        f"{unit} over the budget), and its best after half random's time and after half the "
        "budget.",
        "",
        f"| seed | random best | {arm} best at budget | same within | difference (samples) "
        f"| time to random's best | ratio | {unit} ratio | best at 0.5x time "
        "| at 0.5x budget | goal |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in c["per_seed"]:
        hit = s["to_random_best_s"]
        cells = [
            s["seed"], f"{s['random_best']:.4f}", f"{s['best_at_budget']:.4f}",
            f"{s['same_within']:.4f}", f"{s['difference_in_samples']:+d}",
            f"{hit:.0f} of {s['random_search_s']:.0f} s" if hit is not None else "not reached",
            s["time_ratio"], s["budget_ratio"], _acc(s["best_at_half_time"]),
            _acc(s["best_at_half_budget"]), "met" if s["goal_met"] else "not met",
        ]  # fmt: skip
        lines.append("| " + " | ".join(str(x) for x in cells) + " |")
    r = c["ratio"]
    n = len(c["per_seed"])
    lines += [
        "",
        f"Time to random search's best, {arm} / random: {cell_or_list(r['time_ratio'])}; in "
        f"{unit}, over the budget: {cell_or_list(r['budget_ratio'])}. Goal (the same best "
        f"accuracy in <= 0.5x the wall time) met for {c['goal_met_seeds']} of {n} seeds; with "
        "'the same' read as at least random's best (no tolerance): for "
        f"{c['goal_met_seeds_without_tolerance']}.",
    ]
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
