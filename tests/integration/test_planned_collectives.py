"""The collectives a training step issues are the ones the planner counts, measured on 2 gloo
processes for every zoo model under ddp, zero1, zero2 and zero3 (and with 2 micro-batches).

The planner's step time charges a software cost per collective call (calibrated on CPU), so a
wrong count is a wrong prediction. The counts here come from the torch profiler's record of
the gloo calls of one real step as hpcml builds it (`parallelize`, `shard_optimizer`,
`no_sync`), not from the planner's code. What a wrong planner gets wrong here:
- DDP: one all-reduce per 25 MiB gradient bucket (resnet18 has two), and BatchNorm buffers
  broadcast in the first forward after a gradient sync (so once per step, also with 2
  micro-batches), one call per dtype (float statistics, int64 counter);
- zero1 (torch's ZeroRedundancyOptimizer on DDP): one parameter broadcast per rank, not one
  per tensor (36 for gpt-tiny without `parameters_as_bucket_view`);
- zero2 / zero3 (FSDP2): one all-gather per unit and micro-batch in forward, zero3 again in
  backward for all but the last unit, one gradient reduction per unit per step (an all-reduce
  on gloo, which has no reduce-scatter), or per micro-batch with parallel.accum_reduce
  `micro_batch`.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
from tests import forked

from hpcml.plan.comm import step_communication
from hpcml.plan.hardware import load_catalog, resolve_cluster
from hpcml.plan.memory import Layout, Training
from hpcml.plan.shapes import model_shape

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SEQ = 32
MODELS = ("mlp", "simple_cnn", "gpt-tiny", "resnet18")
STRATEGIES = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}
CASES = (
    [(m, s, 1, "step") for m in MODELS for s in STRATEGIES]
    + [("simple_cnn", s, 2, "step") for s in STRATEGIES]
    # parallel.accum_reduce: micro_batch reduces FSDP2's gradients after every micro-batch.
    + [("simple_cnn", s, 2, "micro_batch") for s in ("zero2", "zero3")]
)
OPS = {
    "gloo:all_reduce": "allreduce",
    "gloo:all_gather": "allgather",
    "gloo:broadcast": "broadcast",
}


def _args(name: str) -> dict[str, int]:
    return {"max_seq_len": SEQ} if name.startswith("gpt") else {}


def _worker(rank: int, world: int, port: int, out: str) -> None:
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
    from torch.profiler import ProfilerActivity, profile

    from hpcml.config import OptimConfig, ParallelConfig, TrainConfig
    from hpcml.distributed.parallel import no_sync, parallelize, shard_optimizer
    from hpcml.distributed.runtime import init_runtime, shutdown
    from hpcml.models.zoo import build_model
    from hpcml.train.losses import cross_entropy
    from hpcml.train.schedule import param_groups

    rt = init_runtime("cpu", "gloo", 120.0)
    g = torch.Generator().manual_seed(rank)
    counts = []
    for name, strategy, accum, reduce in CASES:
        torch.manual_seed(0)
        cfg = ParallelConfig(strategy=strategy)
        model = parallelize(build_model(name, _args(name)), rt, cfg, TrainConfig(), "fp32")
        optim = OptimConfig(name="adamw", lr=1e-3)
        opt = shard_optimizer(
            torch.optim.AdamW(param_groups(model, optim), lr=1e-3), model, rt, cfg
        )

        def step(model=model, opt=opt, name=name, accum=accum, reduce=reduce) -> None:
            for micro in range(accum):
                if name.startswith("gpt"):
                    x = torch.randint(0, 256, (2, SEQ), generator=g)
                    y = torch.randint(0, 256, (2, SEQ), generator=g)
                else:
                    x = torch.randn(2, 3, 32, 32, generator=g)
                    y = torch.randint(0, 10, (2,), generator=g)
                with no_sync(model, micro < accum - 1, reduce):
                    cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        # DDP rebuilds its buckets in the second forward (broadcasting their order once).
        step()
        step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        c: dict[str, int] = {}
        for event in prof.events():
            if event.name in OPS:
                c[OPS[event.name]] = c.get(OPS[event.name], 0) + 1
        counts.append(c)
    if rank == 0:
        Path(out).write_text(json.dumps(counts))
    shutdown(rt)


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, int]]:
    out = tmp_path_factory.mktemp("collectives") / "counts.json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Forked from tests/forked.py's server, which imported torch and the trainer once.
    forked.start_ranks(_worker, (2, port, str(out)))
    return list(json.loads(out.read_text()))


@pytest.mark.parametrize(
    "case", range(len(CASES)), ids=[f"{m}-{s}-m{a}-{r}" for m, s, a, r in CASES]
)
def test_a_step_issues_the_collectives_the_planner_counts(
    measured: list[dict[str, int]], case: int
) -> None:
    name, strategy, accum, reduce = CASES[case]
    cluster = resolve_cluster(load_catalog(), 2, accelerator="cpu")
    layout = Layout(
        zero=STRATEGIES[strategy],
        zero1_whole_tensors=strategy == "zero1",
        micro_batch=2,
        grad_accum=accum,
        accum_reduce=reduce,
    )
    planned: dict[str, float] = {}
    for item in step_communication(
        model_shape(name, _args(name)), layout, Training("fp32"), cluster
    ):
        planned[item.op] = planned.get(item.op, 0) + item.calls_per_step
    assert planned == measured[case]
