"""Replays benchmarks/tune.py's question over many seeds on measured learning curves: how often
can a search reach random search's best in <= 0.5x random search's budget on the digits task?

benchmarks/tune.py runs the real `hpcml tune`, three seeds at a time (about half an hour of this
2-core machine): enough to measure, too few to tell a method from luck when a seed's answer is
a coin flip. Here the training is replaced by a table and everything else is Optuna's own
code: each arm is a real Optuna sampler and pruner (`ask`, `report`, `should_prune`, `tell`),
and a trial's curve is the measured curve of the nearest configuration in the table (same batch
size; nearest in log10 lr, then warmup and log10 weight decay). The table comes from real
`hpcml train` runs of examples/tune_digits.yaml (`--collect N`: random search over the
example's space, no pruning, an evaluation every `--every` steps; `--collect-lr LO HI` over
another learning-rate range, `--append` adding to the saved table), saved beside the result
(`table_sources` says how each part was measured). What it
does not replay: wall time (start-up and evaluations; benchmarks/tune.py measures them: a
pruned search pays more starts), parallel workers, and a configuration's own noise beyond its
neighbours'. So the ratio here is in training samples, as benchmarks/tune.py's `samples ratio`.

Per arm, over `--seeds`: the share of seeds on which the arm came within one binomial standard
error of random search's best (the same seed's random search, as in benchmarks/tune.py) in
<= 0.5x random search's samples, the median ratio, and the chance that the median of three
seeds (benchmarks/tune.py's verdict) is <= 0.5x. Random search against itself is an arm too:
what luck alone answers.

    python benchmarks/tune_replay.py --collect 90   # the table (about 15 min), then the replay
    python benchmarks/tune_replay.py                # the replay again on the saved table
    python benchmarks/tune_replay.py --steps 180 --budget-trials 12 --name tune_replay_steps180
    python benchmarks/tune_replay.py --steps 180 --lr 1e-5 1 --budget-trials 12 \
        --name tune_replay_wide                     # the space with lr over five decades

Writes benchmarks/results/archive/tune_replay.{json,md} (`--name`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
import yaml
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "archive"
CONFIG = ROOT / "examples" / "tune_digits.yaml"
LR = (1e-4, 3e-2)
"""examples/tune_digits.yaml's learning-rate range; `--lr` replays (or `--collect-lr` measures)
another, the rest of its space as it is."""


def space(lr: tuple[float, float]) -> dict[str, Any]:
    """examples/tune_digits.yaml's space with the learning rate in `lr`."""
    return {
        "optim.lr": FloatDistribution(*lr, log=True),
        "optim.weight_decay": FloatDistribution(1e-5, 1e-1, log=True),
        "data.batch_size": CategoricalDistribution([16, 32, 64]),
        "optim.warmup_steps": IntDistribution(0, 10, step=5),
    }
Table = list[dict[str, Any]]


def collect(n: int, steps: int, workers: int, every: int, lr: tuple[float, float]) -> Table:
    """`n` real trials of random search without pruning over the example's space with the
    learning rate in `lr`, an evaluation every `every` steps."""
    with tempfile.TemporaryDirectory(prefix="hpcml-tune-replay-") as tmp:
        out, config = Path(tmp) / "study", Path(tmp) / CONFIG.name
        data = yaml.safe_load(CONFIG.read_text())
        data["tune"]["space"]["optim.lr"].update(low=lr[0], high=lr[1])
        config.write_text(yaml.safe_dump(data))
        cmd = [sys.executable, "-m", "hpcml", "tune", str(config), "tune.sampler=random",
               "tune.pruner=none", "tune.seed=7", f"train.eval_every={every}", f"train.max_steps={steps}",
               f"train.log_every={steps}", "--trials", str(n), "--workers", str(workers),
               "--out", str(out), "--json"]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run(cmd, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
        return read_table(out, CONFIG.stem)


def read_table(out: Path, study_name: str) -> Table:
    """The curves of a study's complete trials (in `out`), read from their runs' records."""
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(out / "study.journal"))
    )
    study = optuna.load_study(study_name=study_name, storage=storage)
    table = []
    for t in study.get_trials(states=(optuna.trial.TrialState.COMPLETE,)):
        lines = (Path(t.user_attrs["run_dir"]) / "run.jsonl").read_text().splitlines()
        evals = [e for e in map(json.loads, lines) if e.get("kind") == "eval"]
        table.append({
            "params": t.params,
            "acc": {e["step"]: e["val_accuracy"] for e in evals},
            "loss": {e["step"]: e["val_loss"] for e in evals},
            "value": t.value,
            "val_samples": evals[-1]["val_samples"],
        })  # fmt: skip
    return table


def nearest(table: Table, params: dict[str, Any]) -> dict[str, Any]:
    """The measured configuration nearest `params`: the same batch size, then log10 lr, with
    warmup (per 5 steps) and log10 weight decay a small part of the distance (lr decides the
    curve in this space; the others break ties among close lrs)."""

    def distance(row: dict[str, Any]) -> float:
        q = row["params"]
        if q["data.batch_size"] != params["data.batch_size"]:
            return math.inf
        return (
            abs(math.log10(q["optim.lr"] / params["optim.lr"]))
            + 0.15 * abs(q["optim.warmup_steps"] - params["optim.warmup_steps"]) / 5
            + 0.02 * abs(math.log10(q["optim.weight_decay"] / params["optim.weight_decay"]))
        )

    return min(table, key=distance)


def search(
    table: Table, sampler: optuna.samplers.BaseSampler, pruner: optuna.pruners.BasePruner,
    rungs: list[int], budget: int, steps: int, lr: tuple[float, float] = LR,
) -> list[tuple[int, float]]:  # fmt: skip
    """One tune: trials start while the largest trial still fits in the sample budget (as
    `tune.sample_budget`); each reports its curve at `rungs` and stops where the pruner says.
    The anytime trace: (samples so far, best complete value so far) after each trial."""
    # A fixed name: Hyperband assigns a trial its bracket from a hash of the study's name.
    study = optuna.create_study(
        study_name="replay", direction="maximize", sampler=sampler, pruner=pruner
    )
    largest, used, best, trace = steps * 64, 0, -1.0, []
    while budget - used >= largest:
        trial = study.ask(space(lr))
        row, batch = nearest(table, trial.params), trial.params["data.batch_size"]
        ran = steps
        for step in rungs:
            if step < steps:
                trial.report(row["acc"][step], step)
                if trial.should_prune():
                    ran = step
                    break
        used += ran * batch
        if ran < steps:
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        else:
            study.tell(trial, row["value"])
            best = max(best, row["value"])
        trace.append((used, best))
    return trace


Arm = Callable[[int], tuple[optuna.samplers.BaseSampler, optuna.pruners.BasePruner, list[int]]]


def arms(steps: int) -> dict[str, Arm]:
    """The arms replayed: hpcml tune's example search (TPE, 3 random start-up trials, ASHA
    with rungs from step 20 at the factor `hpcml tune` picks: 2 at 60 steps, 3 at 180), its
    variants, and random search. The model-guided arms' seed is the seed + 1000, as in
    benchmarks/tune.py."""
    every = list(range(20, steps + 1, 20))
    sh = optuna.pruners.SuccessiveHalvingPruner

    def tpe(seed: int, **kw: Any) -> optuna.samplers.TPESampler:
        kw.setdefault("n_startup_trials", 3)
        return optuna.samplers.TPESampler(seed=seed + 1000, constant_liar=True, **kw)

    rf = 2 if steps <= 60 else 3
    return {
        "random, no pruning": lambda s: (
            optuna.samplers.RandomSampler(seed=s), optuna.pruners.NopPruner(), [steps]),
        "asha+tpe": lambda s: (tpe(s), sh(min_resource=20, reduction_factor=rf), every),
        "asha+tpe, 5 start-up": lambda s: (
            tpe(s, n_startup_trials=5), sh(min_resource=20, reduction_factor=rf), every),
        "asha+tpe, multivariate": lambda s: (
            tpe(s, multivariate=True, group=True), sh(min_resource=20, reduction_factor=rf),
            every),
        "hyperband+tpe": lambda s: (tpe(s), optuna.pruners.HyperbandPruner(
            min_resource=20, max_resource=steps, reduction_factor=rf), every),
        "median+tpe": lambda s: (
            tpe(s), optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=20), every),
        "asha+random": lambda s: (optuna.samplers.RandomSampler(seed=s + 1000),
                                  sh(min_resource=20, reduction_factor=rf), every),
        "tpe, no pruning": lambda s: (tpe(s), optuna.pruners.NopPruner(), [steps]),
    }  # fmt: skip


def ratio(trace: list[tuple[int, float]], rnd: list[tuple[int, float]], n_val: int) -> float:
    """Samples to come within one standard error of random search's best, over random
    search's samples (inf: never)."""
    target = rnd[-1][1]
    tol = math.sqrt(target * (1 - target) / n_val)
    hit = next((used for used, best in trace if best >= target - tol), None)
    return math.inf if hit is None else hit / rnd[-1][0]


def replay(
    table: Table, seeds: int, budget_trials: int, steps: int, lr: tuple[float, float]
) -> dict[str, Any]:
    budget, n_val = budget_trials * steps * 32, table[0]["val_samples"]
    rnd_arm = arms(steps)["random, no pruning"]
    randoms = [search(table, *rnd_arm(s), budget, steps, lr) for s in range(seeds)]
    result = {}
    for name, arm in arms(steps).items():
        traces = randoms if name.startswith("random") else [
            search(table, *arm(s), budget, steps, lr) for s in range(seeds)]  # fmt: skip
        ratios = [ratio(t, r, n_val) for t, r in zip(traces, randoms, strict=True)]
        p = sum(r <= 0.5 for r in ratios) / seeds
        result[name] = {
            "met_share": round(p, 3),
            "median_ratio": round(statistics.median(ratios), 3),
            "median_of_3_met_chance": round(p**3 + 3 * p**2 * (1 - p), 3),
            "median_best": round(statistics.median(t[-1][1] for t in traces), 4),
        }
        print(name, result[name], flush=True)
    return {"budget_samples": budget, "budget_trials": budget_trials, "seeds": seeds,
            "arms": result}  # fmt: skip


def markdown(out: dict[str, Any]) -> str:
    lines = [
        "# hpcml tune: the benchmark's question replayed over many seeds on measured curves",
        "",
        f"`{out['command']}`: {len(out['table'])} measured configurations of "
        f"examples/tune_digits.yaml's space ({out['steps']} steps; the table: "
        f"{'; '.join(out['table_sources'])}), replayed with the learning rate in "
        f"{out['lr'][0]:g} to {out['lr'][1]:g}. Each arm is a real Optuna sampler and pruner. "
        "Met = within one standard error of the same seed's random search's best in <= 0.5x "
        "its samples; the chance column is that of the median of 3 seeds (the benchmark's "
        "verdict) meeting it. Random search against itself is what luck answers.",
    ]
    for b, r in out["replays"].items():
        lines += [
            "",
            f"Budget {r['budget_samples']} samples ({b} trials of {out['steps']} steps at batch "
            f"32), {r['seeds']} seeds:",
            "",
            "| arm | seeds met | median ratio | median of 3 met, chance | median best |",
            "|---|---|---|---|---|",
        ]
        for name, a in r["arms"].items():
            lines.append(f"| {name} | {a['met_share']:.0%} | {a['median_ratio']} | "
                         f"{a['median_of_3_met_chance']:.0%} | {a['median_best']} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--collect", type=int, default=0, help="measure this many trials first")
    p.add_argument("--collect-lr", type=float, nargs=2, default=LR, help="their lr range")
    p.add_argument("--append", action="store_true", help="add them to the saved table")
    p.add_argument("--steps", type=int, default=60, help="train.max_steps of a trial")
    p.add_argument("--workers", type=int, default=2, help="tune workers while collecting")
    p.add_argument("--every", type=int, default=5, help="evaluate every N steps when collecting")
    p.add_argument("--lr", type=float, nargs=2, default=LR, help="the replayed space's lr range")
    p.add_argument("--seeds", type=int, default=100)
    p.add_argument("--budget-trials", type=int, nargs="*", default=[12, 24])
    p.add_argument("--name", default="tune_replay")
    args = p.parse_args()
    path = OUT / f"{args.name}.json"
    table: Table = []
    sources: list[str] = []
    if not args.collect or args.append:
        saved = json.loads(path.read_text())
        table, sources = saved["table"], saved["table_sources"]
    if args.collect:
        lr = tuple(args.collect_lr)
        table += collect(args.collect, args.steps, args.workers, args.every, lr)  # type: ignore[arg-type]
        sources.append(f"--collect {args.collect} --collect-lr {lr[0]:g} {lr[1]:g} "
                       f"--steps {args.steps} --every {args.every}")  # fmt: skip
    for row in table:  # JSON keys are strings
        row["acc"] = {int(k): v for k, v in row["acc"].items()}
        row["loss"] = {int(k): v for k, v in row["loss"].items()}
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    lr = (args.lr[0], args.lr[1])
    out: dict[str, Any] = {
        "command": "python benchmarks/tune_replay.py " + " ".join(sys.argv[1:]),
        "steps": args.steps, "lr": lr, "table_sources": sources, "table": table,
        "replays": {b: replay(table, args.seeds, b, args.steps, lr) for b in args.budget_trials},
    }  # fmt: skip
    OUT.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    text = markdown(out)
    (OUT / f"{args.name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
