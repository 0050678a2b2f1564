"""torchrun worker for test_pipeline_training.py: every pipeline schedule on the same 2 ranks,
in one launch. For each, the stages are built as `hpcml train` builds them (split on the meta
device, each rank materialising its own stages by the seeded per-name initialisation), one
step runs, and the rank writes, into ARGV[1]/rank-R.json, what the test compares with the
whole model computed here alone from the same seed: the loss, every local gradient, the global
gradient norm (over both stages) and the evaluation forward's logits."""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from hpcml.config import ParallelConfig
from hpcml.distributed import meta_init, pipeline
from hpcml.distributed.parallel import grad_norm
from hpcml.distributed.runtime import init_runtime, shutdown
from hpcml.models.zoo import build_model
from hpcml.train.losses import cross_entropy

SEED = 5
ARGS = {"vocab_size": 64, "max_seq_len": 16, "n_layer": 4, "n_head": 2, "d_model": 32}
MODEL = {**ARGS, "tie_embeddings": False}
SCHEDULES = {  # schedule -> (virtual stages per rank, micro-batches of the batch of 8)
    "gpipe": (1, 2),
    "1f1b": (1, 4),
    "interleaved_1f1b": (2, 4),
    "zero_bubble": (2, 4),
}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def reference(x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    model = build_model("gpt-tiny", MODEL)
    meta_init.init_weights(model, SEED, {})  # what materialize fills each stage with
    loss = cross_entropy(model(x), y)
    loss.backward()
    with torch.no_grad():
        logits = model(x)
    grads = {n: p.grad for n, p in model.named_parameters()}
    norm = torch.stack([g.norm() ** 2 for g in grads.values()]).sum().sqrt()
    return {"loss": loss.detach(), "grads": grads, "norm": norm, "logits": logits}


def one_step(rt: Any, name: str, x: torch.Tensor, y: torch.Tensor, ref: dict) -> dict[str, Any]:
    virtual, micro = SCHEDULES[name]
    cfg = ParallelConfig(pp=2, pp_schedule=name, microbatches=micro, virtual_stages=virtual)
    with torch.device("meta"):
        meta = build_model("gpt-tiny", MODEL)
    part = pipeline.split_model(meta, rt, cfg)
    meta_init.materialize(part, rt.device, SEED, {})
    part.pipeline_group, _ = pipeline.process_groups(rt)

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return cross_entropy(out, target) / micro

    schedule, _ = pipeline.build_schedule(part, part, rt, cfg, loss_fn, part.pipeline_group)
    losses: list[torch.Tensor] = []
    first, last = pipeline.is_first(part), pipeline.is_last(part, cfg)
    schedule.step(*((x,) if first else ()), target=y if last else None, losses=losses)
    grads = {n: p.grad for n, p in part.named_parameters()}
    out: dict[str, Any] = {
        "stages": part.pipeline_stages,
        "params": sorted(grads),
        "grad_rel": max(rel(g, ref["grads"][n]) for n, g in grads.items()),
        "norm_rel": rel(grad_norm(part), ref["norm"]),
    }
    logits = pipeline.forward_only(part, x, rt, cfg, part.pipeline_group)
    if last:
        assert logits is not None
        out["loss_rel"] = rel(torch.stack(losses).sum(), ref["loss"])
        out["logits_rel"] = rel(logits, ref["logits"])
    return out


def main() -> None:
    rt = init_runtime("cpu", "gloo", 120.0, 1, 2)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, ARGS["vocab_size"], (8, ARGS["max_seq_len"]), generator=g)
    y = torch.randint(0, ARGS["vocab_size"], (8, ARGS["max_seq_len"]), generator=g)
    ref = reference(x, y)
    result = {name: one_step(rt, name, x, y, ref) for name in SCHEDULES}
    with open(f"{sys.argv[1]}/rank-{rt.rank}.json", "w") as f:
        json.dump(result, f)
    shutdown(rt)


if __name__ == "__main__":
    main()
