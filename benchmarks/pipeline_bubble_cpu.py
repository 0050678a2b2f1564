"""Why is a CPU pipeline's measured bubble far above the planner's? gpt-tiny split into 2 stages
on 2 gloo processes (as `hpcml train` builds them: `hpcml.distributed.pipeline`), one schedule
at a time, with every forward, loss and backward chunk and every pipeline send/receive wait
timed on each rank. Per schedule it reports, each rank's median over the steps after the first:

- measured: the share of the schedule's step the rank spent outside its chunks (what
  `summary.json`'s `measured_bubble` is), split into waiting in pipeline receives/sends and the
  rest (the schedule's own Python work between chunks);
- the chunks' wall time over their CPU time (above 1: the rank was descheduled while computing);
- replays of the measured order (`hpcml.plan.bubble.replay`): with CPU costs and free messages
  (`summary.json`'s `replayed_bubble`, the planner's model), with wall costs, and with wall costs
  plus the one-way latency of a gloo message of one micro-batch's activations measured by
  ping-pong between the two ranks. Where the last one is close to the measured share, the gap
  to the planner is message latency and descheduling against very short chunks, not the
  schedule.

    python benchmarks/pipeline_bubble_cpu.py [--steps 20] [--batch 16] [--seq-len 64]
        [--schedules gpipe:4,1f1b:4,1f1b:8] [--out FILE.json]

Prints a table; with --out, writes the numbers as JSON. Report `uptime`'s load with them.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from hpcml.plan.bubble import bubble_share, replay  # noqa: E402

PINGS = 200


def ping_pong_s(rt: Any, shape: tuple[int, ...]) -> float:
    """Median one-way time of a float32 tensor of `shape` from one rank to the other and back,
    halved (gloo send/recv, as the schedule's messages)."""
    import torch.distributed as dist

    t = torch.zeros(shape)
    times = []
    for _ in range(PINGS):
        t0 = time.perf_counter()
        if rt.rank == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        else:
            dist.recv(t, 0)
            dist.send(t, 0)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / 2


def run_schedule(rt: Any, name: str, m: int, args: argparse.Namespace) -> dict[str, Any]:
    from torch.distributed.pipelining import schedules

    from hpcml.config import ParallelConfig
    from hpcml.distributed import meta_init, pipeline
    from hpcml.models.zoo import build_model
    from hpcml.train.losses import cross_entropy

    cfg = ParallelConfig(pp=2, pp_schedule=name, microbatches=m)
    with torch.device("meta"):
        meta = build_model("gpt-tiny", {"max_seq_len": args.seq_len, "tie_embeddings": False})
    part = pipeline.split_model(meta, rt, cfg)
    meta_init.materialize(part, rt.device, 0, {})
    part.pipeline_group, _ = pipeline.process_groups(rt)

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return cross_entropy(out, target) / m

    schedule, clock = pipeline.build_schedule(part, part, rt, cfg, loss_fn, part.pipeline_group)
    stage = schedule._stage
    chunks: list[tuple[tuple[int, str, int], float, float]] = []  # (action, wall s, cpu s)
    waits: list[float] = []
    last_chunk = [0]

    def timed(method: Any, kind: str) -> Any:
        def run(*a: Any, **k: Any) -> Any:
            chunk = last_chunk[0] if kind == "L" else a[0]
            if kind == "F":
                last_chunk[0] = chunk
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return method(*a, **k)
            finally:
                action = (stage.stage_index, kind, chunk)
                chunks.append((action, time.perf_counter() - t0, time.thread_time() - c0))

        return run

    for method, kind in clock.METHODS.items():
        setattr(stage, method, timed(getattr(stage, method), kind))
    schedule._loss_fn = timed(schedule._loss_fn, "L")
    wait = schedules._wait_batch_p2p

    def timed_wait(work: Any) -> None:
        t0 = time.perf_counter()
        wait(work)
        waits.append(time.perf_counter() - t0)

    schedules._wait_batch_p2p = timed_wait
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (args.batch, args.seq_len), generator=g)
    first, last = pipeline.is_first(part), pipeline.is_last(part, cfg)
    steps, wall_of = [], {}
    try:
        for i in range(args.steps):
            chunks.clear()
            waits.clear()
            part.zero_grad(set_to_none=True)
            t0, c0 = time.perf_counter(), time.thread_time()
            with clock.step(record=i > 0):
                schedule.step(*((x,) if first else ()), target=x if last else None, losses=[])
            step_s, step_cpu_s = time.perf_counter() - t0, time.thread_time() - c0
            if i == 0:
                continue  # shape inference
            for action, wall_s, _ in chunks:
                wall_of.setdefault(action, []).append(wall_s)
            steps.append({
                "step_s": step_s,
                "step_cpu_s": step_cpu_s,
                "chunks_wall_s": sum(c[1] for c in chunks),
                "chunks_cpu_s": sum(c[2] for c in chunks),
                "p2p_wait_s": sum(waits),
            })  # fmt: skip
    finally:
        schedules._wait_batch_p2p = wait
    replayed = clock.replayed()
    wall = [statistics.median(wall_of[tuple(a)]) for a in replayed["order"]]  # type: ignore[index]
    return {"steps": steps, **replayed, "wall_s": wall}


def worker(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2"})  # fmt: skip
    torch.set_num_threads(1)
    from hpcml.distributed.runtime import all_gather_object, init_runtime, shutdown

    rt = init_runtime("cpu", "gloo", 120.0, 1, 2)
    results = {}
    for spec in args.schedules.split(","):
        name, m = spec.split(":")
        micro = args.batch // int(m)
        latency = ping_pong_s(rt, (micro, args.seq_len, 64))
        mine = run_schedule(rt, name, int(m), args)
        results[spec] = {"latency_s": latency, "ranks": all_gather_object(rt, mine)}
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    shutdown(rt)


def median_of(steps: list[dict[str, float]], key: str) -> float:
    return statistics.median(s[key] for s in steps)


def analyse(spec: str, res: dict[str, Any]) -> dict[str, Any]:
    name, m = spec.split(":")
    ranks = res["ranks"]
    orders = {r: [tuple(a) for a in x["order"]] for r, x in enumerate(ranks)}
    cpu = {r: dict(zip(orders[r], x["cpu_s"], strict=True)) for r, x in enumerate(ranks)}
    wall = {r: dict(zip(orders[r], x["wall_s"], strict=True)) for r, x in enumerate(ranks)}
    per_rank = []
    for x in ranks:
        step = median_of(x["steps"], "step_s")
        busy = median_of(x["steps"], "chunks_wall_s")
        per_rank.append({
            "step_s": step,
            "measured_idle": 1 - busy / step,
            "p2p_wait_share": median_of(x["steps"], "p2p_wait_s") / step,
            # CPU the schedule spent outside the chunks (its own Python, posting messages)
            "host_outside_chunks_share": (
                median_of(x["steps"], "step_cpu_s") - median_of(x["steps"], "chunks_cpu_s")
            ) / step,
            "step_wall_over_cpu": step / median_of(x["steps"], "step_cpu_s"),
            "chunks_wall_over_cpu": busy / median_of(x["steps"], "chunks_cpu_s"),
            "chunk_wall_s_median": statistics.median(x["wall_s"]),
        })  # fmt: skip
    return {
        "schedule": name,
        "microbatches": int(m),
        "predicted_bubble": bubble_share(2, int(m), name),
        "latency_s": res["latency_s"],
        "per_rank": per_rank,
        "replayed_cpu": replay(orders, cpu),  # type: ignore[arg-type]
        "replayed_wall": replay(orders, wall),  # type: ignore[arg-type]
        "replayed_wall_latency": replay(orders, wall, res["latency_s"]),  # type: ignore[arg-type]
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--schedules", default="gpipe:4,1f1b:4,1f1b:8")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    raw = Path(f"/tmp/hpcml-pipeline-bubble-{os.getpid()}.json")
    mp.start_processes(worker, args=(port, args, str(raw)), nprocs=2, start_method="spawn")
    rows = {spec: analyse(spec, res) for spec, res in json.loads(raw.read_text()).items()}
    raw.unlink()
    load = os.getloadavg()[0]
    print(f"gpt-tiny, batch {args.batch} x {args.seq_len}, 2 stages on 2 gloo processes, "
          f"load average {load:.1f}")  # fmt: skip
    head = "schedule    pred  measured(r0,r1)  p2p-wait  host-outside  wall/cpu(chunks,step)  "
    print(head + "chunk-ms  lat-ms  replay:cpu  wall  wall+lat")
    for spec, r in rows.items():
        pr = r["per_rank"]
        print(
            f"{spec:<10} {r['predicted_bubble']:.2f}  "
            f"{pr[0]['measured_idle']:.2f},{pr[1]['measured_idle']:.2f}        "
            f"{pr[0]['p2p_wait_share']:.2f},{pr[1]['p2p_wait_share']:.2f}  "
            f"{pr[0]['host_outside_chunks_share']:.2f},{pr[1]['host_outside_chunks_share']:.2f}  "
            f"{pr[0]['chunks_wall_over_cpu']:.2f},{pr[1]['chunks_wall_over_cpu']:.2f} "
            f"{pr[0]['step_wall_over_cpu']:.2f},{pr[1]['step_wall_over_cpu']:.2f}  "
            f"{1e3 * pr[0]['chunk_wall_s_median']:.2f}  {1e3 * r['latency_s']:.2f}  "
            + "  ".join(
                ",".join(f"{v:.2f}" for v in r[k].values())
                for k in ("replayed_cpu", "replayed_wall", "replayed_wall_latency")
            )
        )
    if args.out is not None:
        args.out.write_text(json.dumps({"load_average": load, "args": vars(args) | {"out": None},
                                        "rows": rows}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
