"""Data pipeline benchmark: loader throughput from shards vs the in-memory tensors, the demo's
data-wait share, and the peak RSS of streaming shard sets of two sizes.

1. Loader samples/s over one epoch (after the first batch) of digits-shaped (3x32x32 float32,
   1437 train samples) and cifar-shaped (synthetic 3x32x32, `--cifar-samples`) data, read
   from the in-memory TensorDataset and from the same samples written as shards, with
   data.num_workers 0 and 2. All 8 cases rotate within each of `--reps` repetitions; medians,
   min and max per case.
2. Data wait share of a step on the demo config (`examples/digits_cnn.yaml`, 1 process here;
   `make demo` runs it on 2): sum of data_wait_s over sum of step_time_s from run.jsonl.
3. Peak RSS of a fresh process streaming one shuffled epoch of a synthetic shard set of
   `--small-gb` and `--big-gb` (3x32x32 float32 samples, 64 MB shards, data.shard_cache 4):
   equal peaks for both sizes say the memory is bounded by the cache, not the data. The shard
   sets are deleted afterwards.

4. (`--only shards`) The demo trained from a digits shard set: from a local folder, and from a
   bucket on moto's S3 server on loopback without and with the disk cache: data wait as a share
   of step time, and shard bytes fetched per epoch over the set's bytes (moto's request log).

    python benchmarks/data_pipeline.py [--reps 3] [--small-gb 0.5] [--big-gb 2] [--tmp /tmp]
    python benchmarks/data_pipeline.py --only shards [--shard-epochs 2] [--shard-workers 2]

Results: benchmarks/results/data_pipeline.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def epoch_rate(ds: object, workers: int) -> float:
    from hpcml.config import DataConfig
    from hpcml.data.loader import EpochLoader

    cfg = DataConfig(batch_size=64, num_workers=workers, persistent_workers=False)
    loader = EpochLoader(ds, cfg, 0, 1, 0, False)
    loader.next()  # workers started, first shard mapped
    n, t0 = 0, time.perf_counter()
    while loader.epoch == 0:
        x = loader.next()[0]
        n += len(x)
    return n / (time.perf_counter() - t0)


def loader_cases(tmp: Path, reps: int, cifar_samples: int) -> dict[str, dict[str, float]]:
    from hpcml.config import DataConfig
    from hpcml.data.shards import ShardSet
    from hpcml.data.shards.convert import shard
    from hpcml.data.sources import load_source

    datasets: dict[str, object] = {}
    for name, cfg in {
        "digits": DataConfig(source="digits"),
        "cifar_shaped": DataConfig(source="synthetic", synthetic_samples=cifar_samples),
    }.items():
        datasets[f"{name}/memory"] = load_source(cfg).train
        out = tmp / f"{name}-shards"
        shard(cfg.source, out, synthetic_samples=cifar_samples, shard_size="16MB")
        datasets[f"{name}/shards"] = ShardSet(out, "train")
    runs: dict[str, list[float]] = {}
    for _ in range(reps):
        for key, ds in datasets.items():
            for w in (0, 2):
                runs.setdefault(f"{key}/workers={w}", []).append(epoch_rate(ds, w))
    return {k: _stats(v) for k, v in runs.items()}


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def demo_wait_share(tmp: Path, steps: int) -> dict[str, float]:
    run = tmp / "demo"
    cmd = [sys.executable, "-m", "hpcml", "train", "examples/digits_cnn.yaml", "--run-dir"]
    cmd += [str(run), f"train.max_steps={steps}", "train.eval_every=0", "--quiet"]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    steps_rec = [json.loads(line) for line in (run / "run.jsonl").read_text().splitlines()]
    steps_rec = [r for r in steps_rec if r.get("kind") == "step"][1:]  # step 1: warm-up
    wait = sum(r["data_wait_s"] for r in steps_rec)
    total = sum(r["step_time_s"] for r in steps_rec)
    return {"steps": len(steps_rec), "data_wait_share": wait / total}


def write_big(out: Path, gigabytes: float) -> tuple[float, float]:
    from hpcml.data import shards

    per = 3 * 32 * 32 * 4
    n = int(gigabytes * 2**30 / per)
    pool = np.random.default_rng(0).standard_normal((256, 3, 32, 32), dtype=np.float32)

    def items() -> object:
        for i in range(n):
            yield i, pool[i % 256], np.int64(i % 10)

    header = {
        "sample": {
            "layout": "tensor",
            "x": shards.spec(np.float32, (3, 32, 32)),
            "y": shards.spec(np.int64, ()),
        },
        "num_classes": 10,
        "source": {"name": "benchmark", "path": None, "fingerprint": "synthetic"},
        "transform": {"source_config": {}, "read": {}},
    }
    t0 = time.perf_counter()
    shards.write_shard_set(out, {"train": items()}, header, 64 * 2**20, "none")  # type: ignore[dict-item]
    return n * per / 2**30, time.perf_counter() - t0


STREAM = """
import json, resource, sys
from hpcml.config import DataConfig
from hpcml.data.loader import EpochLoader
from hpcml.data.shards import ShardSet
ds = ShardSet(sys.argv[1], "train", cache_shards=4)
ld = EpochLoader(ds, DataConfig(batch_size=256), 0, 1, 0, False)
n = 0
while True:
    b = ld.next()
    if ld.epoch != 0:
        break
    n += len(b[0])
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"samples": n, "peak_rss_bytes": rss}))
"""


def stream_rss(tmp: Path, sizes: list[float]) -> list[dict[str, float]]:
    rows = []
    for gb in sizes:
        out = tmp / f"big-{gb}"
        written, write_s = write_big(out, gb)
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-c", STREAM, str(out)], capture_output=True, text=True, check=True
        )
        got = json.loads(proc.stdout)
        rows.append(
            {"gib": written, "write_s": write_s, "stream_s": time.perf_counter() - t0, **got}
        )
        shutil.rmtree(out)
    return rows


def _train_wait(tmp: Path, name: str, overrides: list[str], env: dict[str, str]) -> dict:
    """One `hpcml train` of the demo config from shards: data wait over step time (steps after
    the first, which starts the workers and maps the first shards)."""
    run = tmp / f"run-{name}"
    cmd = [sys.executable, "-m", "hpcml", "train", "examples/digits_cnn.yaml", "--run-dir"]
    cmd += [str(run), "train.eval_every=0", "train.checkpoint_every=0", "--quiet", *overrides]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, env=env)
    wall = time.perf_counter() - t0
    recs = [json.loads(line) for line in (run / "run.jsonl").read_text().splitlines()]
    recs = [r for r in recs if r.get("kind") == "step"][1:]
    wait = sum(r["data_wait_s"] for r in recs)
    total = sum(r["step_time_s"] for r in recs)
    return {"steps": len(recs), "data_wait_share": wait / total, "wall_s": wall}


def shards_training(tmp: Path, epochs: int, workers: int) -> dict:
    """The demo trained from a digits shard set (18 shards of about 1 MB): from a local folder,
    and from a bucket on moto's S3 server on loopback without and with `data.cache_dir`; the
    bucket's GETs of training shards (moto's request recorder) in bytes per epoch over the
    training shards' bytes."""
    sys.path.insert(0, str(ROOT))
    from tests.integration.s3_server import CREDENTIALS, MotoServer

    from hpcml.data.shards.convert import shard

    local = tmp / "digits-shards"
    manifest = shard("digits", local, shard_size="1MB", val_fraction=0.2)["manifest"]
    sizes = {s["file"]: int(s["bytes"]) for sp in manifest["splits"].values() for s in sp["shards"]}
    train_bytes = sum(int(s["bytes"]) for s in manifest["splits"]["train"]["shards"])
    n_train = sum(int(s["samples"]) for s in manifest["splits"]["train"]["shards"])
    steps = epochs * (n_train // 32)  # digits_cnn: batch 32, one process
    # The export's drift reference reads data.drift_reference_samples training samples (all
    # 1438 by default) once more after training; 1 keeps that read (1 shard and its read-ahead)
    # out of what the epochs fetch. Evaluation reads val-* shards, which are not counted.
    common = [f"train.max_steps={steps}", "data.source=shards", f"data.num_workers={workers}",
              "data.drift_reference_samples=1"]  # fmt: skip
    env = {**os.environ, **CREDENTIALS}
    out = {"train_samples": n_train, "train_shards": len(manifest["splits"]["train"]["shards"]),
           "train_bytes": train_bytes, "epochs": epochs, "steps": steps, "workers": workers}
    out["local"] = _train_wait(tmp, "local", [*common, f"data.path={local}"], env)
    server = MotoServer(tmp)
    try:
        url = server.upload(local, "hpcml", "digits")
        for name, extra in (("s3", []), ("s3_cache", [f"data.cache_dir={tmp / 'cache'}"])):
            mark = len(server.requests())
            row = _train_wait(tmp, name, [*common, f"data.path={url}", *extra], env)
            names = [p.rsplit("/", 1)[1] for p in server.shard_gets(mark)]
            got = sum(sizes[n] for n in names if n.startswith("train-"))
            row["shard_bytes_fetched"] = got
            row["fetched_per_epoch_over_dataset"] = got / epochs / train_bytes
            out[name] = row
    finally:
        server.stop()
    return out


def shards_markdown(res: dict) -> str:
    lines = [
        "# Training from shards (CPU)",
        "",
        res["note"],
        "",
        f"The demo config (`examples/digits_cnn.yaml`, 1 process, batch 32, "
        f"{res['shards']['workers']} loader workers) for {res['shards']['steps']} steps "
        f"({res['shards']['epochs']} epochs of {res['shards']['train_samples']} samples in "
        f"{res['shards']['train_shards']} shards, {res['shards']['train_bytes']:,} bytes).",
        "",
        "Bytes fetched count the GETs of training shards (moto's request recorder); the run's "
        "export reads 1 drift-reference sample (`data.drift_reference_samples=1`; the default "
        "reads every sampled training shard once more after training).",
        "",
        "| data | data wait / step time | shard bytes fetched per epoch / set bytes |",
        "|---|---|---|",
    ]
    for key, label in (("local", "local folder"), ("s3", "S3 (moto, loopback), no cache"),
                       ("s3_cache", "S3 (moto, loopback), data.cache_dir")):  # fmt: skip
        r = res["shards"][key]
        fetched = r.get("fetched_per_epoch_over_dataset")
        lines.append(
            f"| {label} | {100 * r['data_wait_share']:.2f}% | "
            f"{'-' if fetched is None else f'{fetched:.2f}x'} |"
        )
    return "\n".join(lines) + "\n"


def markdown(res: dict) -> str:
    lines = [
        "# Data pipeline (CPU)",
        "",
        res["note"],
        "",
        "| data / path / workers | samples/s median | min | max |",
        "|---|---|---|---|",
    ]
    for k, v in res["loader"].items():
        lines.append(f"| {k} | {v['median']:.0f} | {v['min']:.0f} | {v['max']:.0f} |")
    d = res["demo"]
    lines += [
        "",
        f"Demo data-wait share: {100 * d['data_wait_share']:.2f}% over {d['steps']} steps.",
        "",
    ]
    lines += [
        "| shard set GiB | samples | peak RSS MB | write s | stream s |",
        "|---|---|---|---|---|",
    ]
    for r in res["stream"]:
        lines.append(
            f"| {r['gib']:.2f} | {r['samples']} | {r['peak_rss_bytes'] / 1e6:.0f} | "
            f"{r['write_s']:.0f} | {r['stream_s']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--cifar-samples", type=int, default=8192)
    p.add_argument("--demo-steps", type=int, default=60)
    p.add_argument("--small-gb", type=float, default=0.5)
    p.add_argument("--big-gb", type=float, default=2.0)
    p.add_argument("--tmp", default="/tmp")
    p.add_argument("--only", choices=["all", "shards"], default="all",
                   help="shards: only training from shards (results in data_pipeline_shards.*)")
    p.add_argument("--shard-epochs", type=int, default=2)
    p.add_argument("--shard-workers", type=int, default=2)
    a = p.parse_args()
    os.environ.setdefault("PYTHONPATH", str(ROOT / "src"))
    if a.only == "shards":
        load = [os.getloadavg()]
        with tempfile.TemporaryDirectory(dir=a.tmp) as d:
            got = shards_training(Path(d), a.shard_epochs, a.shard_workers)
        load.append(os.getloadavg())
        note = (
            "CPU only, 2 cores shared with other sessions' work while measured (load average "
            f"{load[0][0]:.1f} at the start, {load[1][0]:.1f} at the end; 1-minute figures)."
        )
        res = {"note": note, "load_average": load, "args": vars(a), "shards": got}
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "data_pipeline_shards.json").write_text(json.dumps(res, indent=2) + "\n")
        (RESULTS / "data_pipeline_shards.md").write_text(shards_markdown(res))
        print(shards_markdown(res))
        return
    with tempfile.TemporaryDirectory(dir=a.tmp) as d:
        tmp = Path(d)
        res = {
            "note": (
                "CPU only, 2 cores shared with two other sessions' work while measured: "
                "ratios side by side within one invocation, absolute rates noisy."
            ),
            "args": vars(a),
            "loader": loader_cases(tmp, a.reps, a.cifar_samples),
            "demo": demo_wait_share(tmp, a.demo_steps),
            "stream": stream_rss(tmp, [a.small_gb, a.big_gb]),
        }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "data_pipeline.json").write_text(json.dumps(res, indent=2) + "\n")
    (RESULTS / "data_pipeline.md").write_text(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
