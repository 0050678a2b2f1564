"""Resume start-up time against checkpoint size: checkpoint verification before and after
issue 11 (item 7), side by side in one invocation, on real gloo ranks.

  before  rank 0 alone sha256-hashes every file of the newest checkpoint three times (the
          launcher's dry run, the resume choice, and the load), the other ranks waiting;
          replayed with the same functions: `ckpt_manifest.verify(path, "full")` three times
          on rank 0, then the load
  after   `rundir.resolve_shared` (every rank hashes its share of the files once; here the
          files it wrote) then the load, which does not verify again
  size    the same with fault.checkpoint_verify=size (no hashing)

Each repetition is timed on rank 0 from a barrier before the choice to a barrier after the
load (`dcp.load` of model and optimizer included in all three), alternating the modes so that
machine noise hits all alike. The checkpoint files are in the page cache (just written), as
right after a save; a cold read from a network filesystem adds the same read time to every
mode once (and to `before` three times).

    python benchmarks/checkpoint_verify.py [--sizes-mb 16 64 256] [--reps 5] [--ranks 2]

Writes benchmarks/results/checkpoint_verify.json and .png and prints a table. Not part of the
test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

RESULTS = Path(__file__).resolve().parent / "results"
MODES = ("before", "after", "size")


def _model(total_mb: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A linear layer whose weights + AdamW's two moments fill about `total_mb` MiB."""
    n = int((total_mb * 2**20 / 3 / 4) ** 0.5)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(n, n, bias=False))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, n)).sum().backward()
    opt.step()
    return model, opt


def _startup(mode: str, run: Path, model: Any, opt: Any, rt: Any) -> float:
    from hpcml.distributed.runtime import barrier, broadcast_object
    from hpcml.train import rundir
    from hpcml.train.checkpoint import manifest as ckpt_manifest
    from hpcml.train.checkpoint import store as ckpt

    ckpt_manifest._verified.clear()
    barrier(rt)
    t0 = time.perf_counter()
    if mode == "before":
        found = ckpt.list_complete(run / "checkpoints")[0]
        if rt.is_main:
            for _ in range(3):  # launcher dry run, resume choice, load: each a full pass
                assert ckpt_manifest.verify(found, "full") is None
        broadcast_object(rt, None)
        ckpt_manifest._verified.add(ckpt_manifest._key(found))  # type: ignore[arg-type]
    else:
        found = rundir.resolve_shared(
            rt, run, "auto", False, mode="full" if mode == "after" else "size"
        )
        assert found is not None
    ckpt.load(found, model, opt, rt)
    barrier(rt)
    return time.perf_counter() - t0


def _worker(rank: int, world: int, port: int, sizes: list[int], reps: int, out: str) -> None:
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world),
        }
    )
    torch.set_num_threads(1)
    from hpcml.distributed.runtime import init_runtime, shutdown
    from hpcml.train.checkpoint import store as ckpt

    rt = init_runtime(device="cpu", backend="gloo", timeout_s=600)
    rows = []
    tmp = out  # one folder shared by the ranks (the launcher's temporary one)
    for size in sizes:
        model, opt = _model(size)
        run = Path(tmp) / f"run-{size}"
        path = ckpt.save(run / "checkpoints", 1, model, opt, {"epoch": 0}, {"data": {}}, rt, 1)
        nbytes = sum(p.stat().st_size for p in path.iterdir())
        times: dict[str, list[float]] = {m: [] for m in MODES}
        for _ in range(reps):
            for mode in MODES:
                times[mode].append(_startup(mode, run, model, opt, rt))
        rows.append({"size_mb": size, "checkpoint_bytes": nbytes, "times_s": times})
        del model, opt
    if rt.is_main:
        Path(out, "rows.json").write_text(json.dumps(rows))
    shutdown(rt)


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for row in rows:
        row["median_s"] = {m: statistics.median(t) for m, t in row["times_s"].items()}
        row["min_s"] = {m: min(t) for m, t in row["times_s"].items()}
        row["max_s"] = {m: max(t) for m, t in row["times_s"].items()}
        row["speedup_after_vs_before"] = row["median_s"]["before"] / row["median_s"]["after"]
    return rows


def plot(rows: list[dict[str, Any]], path: Path, ranks: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    x = [r["checkpoint_bytes"] / 2**20 for r in rows]
    for mode in MODES:
        med = [r["median_s"][mode] for r in rows]
        lo = [r["median_s"][mode] - r["min_s"][mode] for r in rows]
        hi = [r["max_s"][mode] - r["median_s"][mode] for r in rows]
        ax.errorbar(x, med, yerr=[lo, hi], marker="o", capsize=3, label=mode)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("checkpoint size (MiB)")
    ax.set_ylabel("resume start-up: choice + verify + load (s)")
    ax.set_title(f"checkpoint verification at resume, {ranks} gloo ranks (median, min-max)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--ranks", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as out:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_worker, args=(args.ranks, port, args.sizes_mb, args.reps, out), nprocs=args.ranks)
        rows = summarize(json.loads(Path(out, "rows.json").read_text()))
    RESULTS.mkdir(exist_ok=True)
    result = {
        "benchmark": "checkpoint_verify",
        "ranks": args.ranks,
        "reps": args.reps,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "torch": torch.__version__,
        "rows": rows,
    }
    (RESULTS / "checkpoint_verify.json").write_text(json.dumps(result, indent=1))
    plot(rows, RESULTS / "checkpoint_verify.png", args.ranks)
    print(f"resume start-up, {args.ranks} ranks, median (min-max) of {args.reps} repetitions")
    print(f"{'size MiB':>9}" + "".join(f"{m:>24}" for m in MODES) + f"{'before/after':>14}")
    for r in rows:
        cells = "".join(
            f"{r['median_s'][m]:>10.3f} s ({r['min_s'][m]:.2f}-{r['max_s'][m]:.2f})" for m in MODES
        )
        print(f"{r['checkpoint_bytes'] / 2**20:>9.0f}{cells}{r['speedup_after_vs_before']:>13.2f}x")


if __name__ == "__main__":
    main()
