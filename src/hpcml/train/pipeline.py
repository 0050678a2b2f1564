"""A training step and an evaluation forward under pipeline parallelism (`parallel.pp`).

Each step takes one `data.batch_size` batch per data-parallel replica (every rank of a pipeline
reads the same one: the first stage uses its inputs, the last its targets) for each of
`train.grad_accum` rounds; the schedule splits it into `parallel.microbatches` micro-batches.
The loss is divided by micro-batches x accumulation before backward, so the gradients are those
of the batch's mean loss, as one process computes them.

The step's loss lives on the last stage. The log's reduction averages over every rank, so the
last stage reports it times pp and the other stages zero: the average is the replicas' mean,
with no collective of its own.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from hpcml.config import RunConfig
from hpcml.distributed import pipeline as pp
from hpcml.distributed.runtime import all_gather_object
from hpcml.errors import ConfigError
from hpcml.plan.bubble import bubble_share, replay
from hpcml.train.memprobe import InFlightActivations


def check_run(cfg: RunConfig) -> None:
    """What pipeline parallelism does not run with yet, refused in one sentence before any
    worker starts (the layout itself is `hpcml.distributed.pipeline.check_pipeline`'s)."""
    if cfg.parallel.pp == 1:
        return
    where = f"parallel.pp {cfg.parallel.pp}"
    refused = {
        "train.activation_checkpointing": cfg.train.activation_checkpointing != "none",
        "train.compile": cfg.train.compile,
        "precision fp16 (loss scaling)": cfg.precision == "fp16",
        "train.eval_sets": bool(cfg.train.eval_sets),
        f"finetune.method {cfg.finetune.method}": cfg.finetune.method != "full",
        "model.init_from": cfg.model.init_from is not None,
    }
    for what, on in refused.items():
        if on:
            raise ConfigError(
                f"{what} does not run under {where} yet; remove it or set parallel.pp=1."
            )


class PipelineStep:
    """The schedule of this rank's stage and the step and evaluation forwards that use it."""

    def __init__(self, trainer: Any) -> None:
        cfg, rt = trainer.cfg, trainer.rt
        self.cfg, self.rt = cfg, rt
        self.part = getattr(trainer.model, "module", trainer.model)  # under DDP: the stage
        self.group = self.part.pipeline_group
        self.first = pp.is_first(self.part)
        self.last = pp.is_last(self.part, cfg.parallel)
        scale = pp.microbatches(cfg.parallel) * cfg.train.grad_accum
        loss_fn = trainer.loss_fn

        def scaled_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return loss_fn(output, target) / scale

        self.schedule, self.clock = pp.build_schedule(
            self.part, trainer.model, rt, cfg.parallel, scaled_loss, self.group
        )
        # Saved activations alive at once in the second step (the first infers shapes).
        self.activations = InFlightActivations(trainer.model, pp.microbatches(cfg.parallel))
        self.steps = 0
        self.step_s = 0.0  # schedule time of the steps after the first (which infers shapes)
        self.busy_s = 0.0  # of which this rank's stages computed

    def forward_backward(self, trainer: Any) -> tuple[torch.Tensor, float]:
        accum, dev = self.cfg.train.grad_accum, self.rt.device
        trainer.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=dev)
        data_wait = 0.0
        for micro in range(accum):
            td = time.perf_counter()
            with trainer.phase("hpcml.data"):
                x, y = trainer.train_data.next()
            data_wait += time.perf_counter() - td
            losses: list[torch.Tensor] = []
            args = (x.to(dev, non_blocking=True),) if self.first else ()
            target = y.to(dev, non_blocking=True) if self.last else None
            busy, t0 = self.clock.busy_s, time.perf_counter()
            with (
                trainer.precision.autocast(),
                trainer.hooks.forward(trainer),
                trainer.phase("hpcml.pipeline"),
                self.clock.step(record=self.steps > 0),
                self.activations.sample(active=self.steps == 1 and micro == 0),
            ):
                self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
            if self.steps > 0:
                self.step_s += time.perf_counter() - t0
                self.busy_s += self.clock.busy_s - busy
            if self.last:
                loss_sum += torch.stack([loss.detach().float() for loss in losses]).sum()
        if self.last:  # the log averages over all ranks: see the module docstring
            loss_sum *= self.cfg.parallel.pp
        self.steps += 1
        return loss_sum, data_wait

    def summary_block(self) -> dict[str, Any]:
        """The bubble, beside the planner's: measured (each rank's share of its schedule time
        not spent computing, over the steps after the first) and replayed (the idle share of
        the busiest rank when each pipeline's actions run in their measured order, each for
        the median CPU time of its stage and kind, without waits: `hpcml.plan.bubble.replay`).
        Every rank must call it."""
        p = self.cfg.parallel
        idle = 1.0 - self.busy_s / self.step_s if self.step_s > 0 else None
        # A pipeline is the ranks of one (dp, tp) place, one per stage.
        line = self.rt.rank % (self.rt.world_size // self.rt.pp)
        mine = {"idle": idle, "pipeline": line, **self.clock.replayed()}
        mine["activations"] = {"stages": self.part.pipeline_stages, **self.activations.result()}
        every = all_gather_object(self.rt, mine)
        per_rank = [r["idle"] for r in every]
        measured = [x for x in per_rank if x is not None]
        replayed = replayed_idle(every)
        return {
            "schedule": p.pp_schedule,
            "stages": p.pp * p.virtual_stages,
            "microbatches": pp.microbatches(p),
            "predicted_bubble": bubble_share(
                p.pp, pp.microbatches(p), p.pp_schedule, p.virtual_stages
            ),
            "measured_bubble": sum(measured) / len(measured) if measured else None,
            "measured_bubble_per_rank": per_rank,
            "replayed_bubble": min(replayed) if replayed else None,
            "replayed_bubble_per_rank": replayed or None,
            # Each rank's peak of saved activations in one step (bytes alive at once) and
            # what one micro-batch saved (`hpcml.train.memprobe.InFlightActivations`).
            "activations_per_rank": [r["activations"] for r in every],
        }

    def eval_forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """Logits of `x` on the last stage's rank; None on the others."""
        return pp.forward_only(self.part, x, self.rt, self.cfg.parallel, self.group)


def replayed_idle(ranks: list[dict[str, Any]]) -> list[float]:
    """Each rank's replayed idle share (`hpcml.plan.bubble.replay`, one pipeline at a time),
    from what `StageClock.replayed` gave on every rank; empty before a step was recorded."""
    if not all(r["order"] for r in ranks):
        return []
    out: dict[int, float] = {}
    for line in {r["pipeline"] for r in ranks}:
        members = {i: r for i, r in enumerate(ranks) if r["pipeline"] == line}
        orders = {i: [tuple(a) for a in r["order"]] for i, r in members.items()}
        costs = {i: dict(zip(orders[i], r["cpu_s"], strict=True)) for i, r in members.items()}
        out.update(replay(orders, costs))  # type: ignore[arg-type]
    return [out[i] for i in range(len(ranks))]
