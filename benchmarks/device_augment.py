"""Augmentation and normalization on the CPU loader vs on the device, side by side.

An image-folder shard set (`--images` seeded noise PNGs of 32x32, stored as uint8) is read for
one epoch by `hpcml.data.loader.EpochLoader`, as `hpcml train` reads it, in two ways:

  cpu      data.augment_on: cpu: the loader normalizes each sample to float32 and crops and
           flips it (`AugmentedImages`), then the batch is handed over
  device   data.augment_on: device: the loader hands over uint8 batches, and the "device" (this
           CPU: no GPU here) normalizes, crops and flips the whole batch (`DeviceNormalize`,
           `DeviceAugment`), as the trainer does after the transfer

Reported per case and `--workers` setting: samples/s through loader + transforms (median and
[min .. max] over `--reps` rotating repetitions) and the bytes of one batch as handed over by
the loader (what pinned memory and a host-to-device copy would carry). On a GPU the device
half would run there, in parallel with the loader; this CPU-only figure counts it in series.

    python benchmarks/device_augment.py [--images 4096] [--reps 3] [--workers 0 2]

Results: benchmarks/results/device_augment.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def write_images(root: Path, n: int, classes: int = 10) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in range(classes):
        (root / f"c{c}").mkdir(parents=True)
    for k in range(n):
        img = rng.integers(0, 256, size=(32, 32, 3), dtype=np.uint8)
        Image.fromarray(img).save(root / f"c{k % classes}" / f"{k}.png")


def one_epoch(path: Path, mode: str, workers: int) -> tuple[float, int]:
    from hpcml.config import DataConfig
    from hpcml.data.device_augment import DeviceAugment
    from hpcml.data.loader import EpochLoader
    from hpcml.data.sources import load_source

    cfg = DataConfig(
        source="shards",
        path=str(path),
        augment=True,
        augment_on=mode,  # type: ignore[arg-type]
        batch_size=128,
        num_workers=workers,
        persistent_workers=False,
    )
    splits = load_source(cfg)
    augment = DeviceAugment(0, 0, splits.num_classes) if mode == "device" else None
    loader = EpochLoader(splits.train, cfg, 0, 1, 0, False)
    x, y = loader.next()  # workers started, first shard mapped
    batch_bytes = x.element_size() * x.numel()
    n, step, t0 = 0, 0, time.perf_counter()
    while loader.epoch == 0:
        x, y = loader.next()
        if splits.device_normalize is not None:
            x = splits.device_normalize(x)
        if augment is not None:
            x, y = augment.apply(x, y, step, 0)
        n += len(x)
        step += 1
    return n / (time.perf_counter() - t0), batch_bytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=4096)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    p.add_argument("--note", default="")
    args = p.parse_args()
    torch.set_num_threads(1)
    from hpcml.data.shards.convert import shard

    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        write_images(Path(tmp) / "imgs", args.images)
        out = Path(tmp) / "shards"
        shard(str(Path(tmp) / "imgs"), out, image_size=32, shard_size="16MB", val_fraction=0.1)
        cases = [(m, w) for w in args.workers for m in ("cpu", "device")]
        rates: dict[str, list[float]] = {f"{m} w{w}": [] for m, w in cases}
        sizes: dict[str, int] = {}
        for rep in range(args.reps):
            order = cases[rep % len(cases) :] + cases[: rep % len(cases)]
            for mode, workers in order:
                rate, size = one_epoch(out, mode, workers)
                rates[f"{mode} w{workers}"].append(rate)
                sizes[mode] = size
                print(f"rep {rep} {mode:6s} workers {workers}: {rate:8.0f} samples/s", flush=True)
    summary = {
        k: {"median": statistics.median(v), "min": min(v), "max": max(v), "runs": v}
        for k, v in rates.items()
    }
    ratios = {
        f"device / cpu, workers {w}": summary[f"device w{w}"]["median"]
        / summary[f"cpu w{w}"]["median"]
        for w in args.workers
    }
    res = {
        "benchmark": "device_augment",
        "images": args.images,
        "batch_size": 128,
        "reps": args.reps,
        "samples_per_s": summary,
        "batch_bytes": sizes,
        "ratios": ratios,
        "note": args.note,
        "load_average_1m": {"start": load_start, "end": os.getloadavg()[0]},
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
        },
        "command": shlex.join(["python", "benchmarks/device_augment.py", *sys.argv[1:]]),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "device_augment.json").write_text(json.dumps(res, indent=2) + "\n")
    (RESULTS / "device_augment.md").write_text(markdown(res))
    print(markdown(res))


def markdown(res: dict) -> str:
    lines = [
        f"Crop + flip + normalization in the CPU loader vs on the device (this CPU), one epoch of "
        f"{res['images']} 32x32 images from an image shard set, batch {res['batch_size']}, "
        f"median [min .. max] of {res['reps']} rotating repetitions.",
        "",
        f"Note: {res['note']} 1-minute load average {res['load_average_1m']['start']:.1f} at the "
        f"start, {res['load_average_1m']['end']:.1f} at the end.",
        "",
        "| path | samples/s |",
        "|---|---:|",
    ]
    for k, s in res["samples_per_s"].items():
        lines.append(f"| {k} | {s['median']:,.0f} [{s['min']:,.0f} .. {s['max']:,.0f}] |")
    lines += [""]
    lines += [f"{k}: {v:.2f}x (ratio of medians)  " for k, v in res["ratios"].items()]
    b = res["batch_bytes"]
    lines += [
        "",
        f"Bytes of one batch handed over by the loader: cpu {b['cpu']:,}, device {b['device']:,} "
        f"({b['cpu'] / b['device']:.0f}x fewer).",
        "",
        f"Command: `{res['command']}`",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
