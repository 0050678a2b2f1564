"""Does MLflow tracking slow training? The same short training run with tracking on and off,
alternating, in one invocation; reports ratios (on / off).

Two measurements:
  loop  a real torch training loop in this process (an MLP on digits by default: a short step
        makes any tracking cost stand out; --model simple_cnn for the example's model) calling
        the tracker as the engine does (records handed over every 10 steps).
  cli   `hpcml train examples/digits_cnn.yaml` end to end with tracking.backend=mlflow vs none
        (needs the training engine): the engine's median step time from summary.json, and the
        command's wall and CPU time, which include MLflow's import and the final artifact
        upload (a fixed cost per run, not per step).

CPU time (all threads of the process, so MLflow's background writer counts) is reported
next to wall time because it barely moves when other jobs share the machine; wall-clock
ratios on a busy machine are noise. The loop runs torch on one thread so CPU time counts
work, not OpenMP spinning.

    python benchmarks/tracking_overhead.py [--mode loop|cli|both] [--repeats 5] [--steps 200]
        [--cli-repeats 3] [--cli-steps 60]

Writes benchmarks/results/tracking_overhead.json and .png.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "src"))


def loop_run(
    steps: int, tracking: bool, log_every: int, store: str, workdir: Path, model_name: str
) -> dict:
    """One training loop; returns per-step times and the tracker's fixed start/finish cost."""
    import torch
    import torch.nn.functional as F

    from hpcml.config import DataConfig, TrackingConfig, flatten, load_config
    from hpcml.data.sources import load_digits
    from hpcml.models.zoo import build_model
    from hpcml.track.mlflow import MlflowTracker, NullTracker

    torch.manual_seed(0)
    splits = load_digits(DataConfig(source="digits", batch_size=32))
    loader = torch.utils.data.DataLoader(splits.train, batch_size=32, shuffle=True, drop_last=True)
    model = build_model(model_name, {})
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    cfg = TrackingConfig(backend="mlflow", uri=store, experiment="bench", log_every=log_every)
    run_dir = Path(tempfile.mkdtemp(dir=workdir))
    tracker: MlflowTracker | NullTracker = (
        MlflowTracker(cfg, run_dir) if tracking else NullTracker()
    )
    t0 = time.perf_counter()
    tracker.start(flatten(load_config(None)), {"bench": "tracking_overhead"})
    start_s = time.perf_counter() - t0
    step_times, pending, step, in_tracker, in_tracker_cpu = [], [], 0, 0.0, 0.0
    it = iter(loader)
    loop_t0, cpu_t0 = time.perf_counter(), time.process_time()
    while step < steps:
        t = time.perf_counter()
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(loader)
            x, y = next(it)
        wait = time.perf_counter() - t
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        pending.append(
            {
                "step": step,
                "loss": loss.item(),
                "lr": 2e-3,
                "samples_per_s": 32 / (time.perf_counter() - t),
                "step_time_s": time.perf_counter() - t,
                "data_wait_s": wait,
            }
        )
        # As the engine does: records flushed every train.log_every (10) steps.
        if step % 10 == 0:
            tc, tcc = time.perf_counter(), time.thread_time()
            tracker.log_steps(pending)
            in_tracker += time.perf_counter() - tc
            in_tracker_cpu += time.thread_time() - tcc
            pending = []
        step_times.append(time.perf_counter() - t)
    loop_s = time.perf_counter() - loop_t0
    loop_cpu_s = time.process_time() - cpu_t0
    t0 = time.perf_counter()
    tracker.finish({"steps": steps, "final": {"train_loss": loss.item()}}, "finished", run_dir)
    finish_s = time.perf_counter() - t0
    return {
        "median_step_s": statistics.median(step_times[10:]),
        "loop_s": loop_s,
        "cpu_ms_per_step": loop_cpu_s / steps * 1e3,
        "tracker_us_per_step": in_tracker / steps * 1e6,
        "tracker_cpu_us_per_step": in_tracker_cpu / steps * 1e6,
        "start_s": start_s,
        "finish_s": finish_s,
    }


def bench_loop(repeats: int, steps: int, workdir: Path, model_name: str) -> dict:
    import torch

    torch.set_num_threads(1)
    from hpcml.track.store import open_client

    _, store = open_client(f"sqlite:///{workdir / 'mlruns.db'}")  # migrations outside the timing
    loop_run(20, False, 10, store, workdir, model_name)  # warm-up: allocator, data, kernels
    variants = {"off": (False, 10), "on (log_every=10)": (True, 10), "on (log_every=1)": (True, 1)}
    runs: dict[str, list[dict]] = {k: [] for k in variants}
    for _ in range(repeats):
        for name, (tracking, log_every) in variants.items():  # alternating: drift hits all alike
            runs[name].append(loop_run(steps, tracking, log_every, store, workdir, model_name))
    base = statistics.median(r["median_step_s"] for r in runs["off"])
    base_loop = statistics.median(r["loop_s"] for r in runs["off"])
    base_cpu = statistics.median(r["cpu_ms_per_step"] for r in runs["off"])
    out = {}
    for name, rs in runs.items():
        med = statistics.median(r["median_step_s"] for r in rs)
        loop = statistics.median(r["loop_s"] for r in rs)
        out[name] = {
            "median_step_ms": med * 1e3,
            "step_ratio": med / base,
            "loop_s": loop,
            "loop_ratio": loop / base_loop,
            "cpu_ms_per_step": statistics.median(r["cpu_ms_per_step"] for r in rs),
            "cpu_ratio": statistics.median(r["cpu_ms_per_step"] for r in rs) / base_cpu,
            "tracker_us_per_step": statistics.median(r["tracker_us_per_step"] for r in rs),
            "tracker_cpu_us_per_step": statistics.median(r["tracker_cpu_us_per_step"] for r in rs),
            "start_s": statistics.median(r["start_s"] for r in rs),
            "finish_s": statistics.median(r["finish_s"] for r in rs),
            "runs": rs,
        }
    return out


def cli_run(steps: int, tracking: bool, store: str, workdir: Path) -> dict:
    run_dir = Path(tempfile.mkdtemp(dir=workdir)) / "run"
    args = [
        sys.executable, "-m", "hpcml", "train", str(ROOT / "examples" / "digits_cnn.yaml"),
        f"train.max_steps={steps}", "train.eval_every=0", "train.checkpoint_every=0",
        f"tracking.backend={'mlflow' if tracking else 'none'}", f"tracking.uri={store}",
        "tracking.experiment=bench", "--run-dir", str(run_dir), "--quiet",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=workdir)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode != 0:
        raise SystemExit(f"hpcml train failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"wall_s": wall, "cpu_s": cpu, "step_time_s": summary["throughput"]["step_time_s"]}


def bench_cli(repeats: int, steps: int, workdir: Path) -> dict:
    from hpcml.track.store import open_client

    _, store = open_client(f"sqlite:///{workdir / 'mlruns-cli.db'}")
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for _ in range(repeats):
        for name in runs:
            runs[name].append(cli_run(steps, name == "on", store, workdir))
    base_step = statistics.median(r["step_time_s"] for r in runs["off"])
    base_wall = statistics.median(r["wall_s"] for r in runs["off"])
    base_cpu = statistics.median(r["cpu_s"] for r in runs["off"])
    out = {}
    for name, rs in runs.items():
        step = statistics.median(r["step_time_s"] for r in rs)
        wall = statistics.median(r["wall_s"] for r in rs)
        out[name] = {
            "median_step_ms": step * 1e3,
            "step_ratio": step / base_step,
            "wall_s": wall,
            "wall_ratio": wall / base_wall,
            "cpu_s": statistics.median(r["cpu_s"] for r in rs),
            "cpu_ratio": statistics.median(r["cpu_s"] for r in rs) / base_cpu,
            "runs": rs,
        }
    return out


def engine_available() -> bool:
    return (ROOT / "src" / "hpcml" / "train" / "entry.py").exists()


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [k for k in ("loop", "cli") if k in result]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.5), squeeze=False)
    for ax, key in zip(axes[0], panels, strict=True):
        names = list(result[key])
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], [result[key][n]["step_ratio"] for n in names], 0.4,
               label="median step time (wall)")  # fmt: skip
        ax.bar([x + 0.2 for x in xs], [result[key][n]["cpu_ratio"] for n in names], 0.4,
               label="CPU time")  # fmt: skip
        ax.set_xticks(list(xs), names)
        ax.axhline(1.0, color="grey", lw=1, ls="--")
        ax.set_ylabel("tracking on / off")
        ax.legend(fontsize=7, loc="lower center")
        ax.set_title(f"{key}: tracking overhead")
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--mode", choices=["loop", "cli", "both"], default="both")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--model", default="mlp", help="zoo model for the loop measurement")
    ap.add_argument("--cli-steps", type=int, default=60, help="steps per `hpcml train` run")
    ap.add_argument("--cli-repeats", type=int, default=3)
    args = ap.parse_args()
    result: dict[str, Any] = {
        "steps": args.steps,
        "repeats": args.repeats,
        "loop_model": args.model,
        "cpus": os.cpu_count(),
        "command": " ".join(sys.argv),
    }
    with tempfile.TemporaryDirectory(prefix="hpcml-bench-track-") as tmp:
        work = Path(tmp)
        if args.mode in ("loop", "both"):
            result["loop"] = bench_loop(args.repeats, args.steps, work, args.model)
        if args.mode in ("cli", "both"):
            if engine_available():
                result["cli"] = bench_cli(args.cli_repeats, args.cli_steps, work)
                result["cli_steps"], result["cli_repeats"] = args.cli_steps, args.cli_repeats
            else:
                print("cli mode skipped: the training engine (hpcml.train.entry) is not here yet")

    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"tracking overhead: loop {args.steps} steps x {args.repeats}, "
        f"hpcml train {args.cli_steps} steps x {args.cli_repeats} (medians)"
    )
    cols = ("measure", "variant", "median step ms", "step ratio", "wall s", "wall ratio",
            "CPU", "CPU ratio", "in tracker µs/step (CPU)")  # fmt: skip
    for col in cols:
        table.add_column(col, justify="left" if col in ("measure", "variant") else "right")
    for name, r in (result.get("loop") or {}).items():
        table.add_row(
            "loop", name, f"{r['median_step_ms']:.2f}", f"{r['step_ratio']:.3f}",
            f"{r['loop_s']:.2f}", f"{r['loop_ratio']:.3f}",
            f"{r['cpu_ms_per_step']:.2f} ms/step", f"{r['cpu_ratio']:.3f}",
            f"{r['tracker_us_per_step']:.0f} ({r['tracker_cpu_us_per_step']:.0f})",
        )  # fmt: skip
    for name, r in (result.get("cli") or {}).items():
        table.add_row(
            "hpcml train", name, f"{r['median_step_ms']:.2f}", f"{r['step_ratio']:.3f}",
            f"{r['wall_s']:.2f}", f"{r['wall_ratio']:.3f}",
            f"{r['cpu_s']:.2f} s/run", f"{r['cpu_ratio']:.3f}", "-",
        )  # fmt: skip
    Console(width=170).print(table)
    for name, r in (result.get("loop") or {}).items():
        if name != "off":
            print(f"loop {name}: tracker start {r['start_s']:.3f} s, finish {r['finish_s']:.3f} s")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "tracking_overhead.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, RESULTS / "tracking_overhead.png")
    print(f"wrote {RESULTS / 'tracking_overhead.json'} and .png")


if __name__ == "__main__":
    main()
