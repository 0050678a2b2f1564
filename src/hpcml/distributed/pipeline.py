"""Pipeline parallelism (`parallel.pp`) through `torch.distributed.pipelining`: the model's
blocks split into stages on the meta device, each rank materialising only its own stages, and a
schedule (GPipe, 1F1B, interleaved 1F1B, interleaved zero-bubble) that runs micro-batches
through them.

The mesh is (pp, dp, tp), pp outermost (`pipeline_mesh`): rank r holds stage s = `r // (dp tp)`
(and, with `parallel.virtual_stages` v, stages `s + k pp` for k < v) of data-parallel replica
`(r // tp) % dp`. A stage is replicated over its dp ranks by DDP or sharded by FSDP2
(`parallel.strategy`), and split over its tp ranks by the model's tensor-parallel plan, as a
whole model would be (`hpcml.distributed.parallel.parallelize`, on the mesh's slices). A stage
keeps the whole model's parameter names (`blocks.3.attn.wq.weight`), so seeded initialisation
gives every stage the weights one process would have, and checkpoints are keyed as without
pipelining.

What a rank holds (`StagePart`): the union of its stages, as one module for the optimizer,
gradient clipping and checkpoints; its stages are views over the same submodules.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from hpcml.config import ParallelConfig
from hpcml.distributed.pipeline_clock import StageClock
from hpcml.distributed.runtime import Runtime
from hpcml.errors import ConfigError

SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "zero_bubble": "ScheduleInterleavedZeroBubble",
}
"""parallel.pp_schedule -> its class in torch.distributed.pipelining."""
SINGLE_STAGE = ("gpipe", "1f1b")
"""Schedules that run one stage per process; the others take `virtual_stages` per process."""
DATA_PARALLEL = ("ddp", "zero2", "zero3", "fsdp")
"""parallel.strategy values that replicate a stage over data-parallel ranks: DDP, or FSDP2 on
the mesh's dp dimension (the stage's module is the FSDP root; `PipelineStage` reduces its
gradients once per step)."""


def microbatches(cfg: ParallelConfig) -> int:
    return cfg.microbatches if cfg.microbatches is not None else cfg.pp


class StagePart(nn.Module):
    """What a rank holds of a pipelined model; `split_model` fills the pipeline attributes."""

    cfg: Any
    pipeline_stages: list[int]
    """The indices of this rank's stages."""
    pipeline_views: list[nn.Module]
    """Its stages, in that order: modules over the part's own submodules."""
    pipeline_group: Any = None
    """The process group of its pipeline (set once the process group exists)."""
    pipeline_clock: StageClock | None = None
    """The clock of its stages' compute (set by `build_schedule`)."""


class GPTStage(StagePart):
    """A contiguous piece of a `gpt` (hpcml.models.gpt): the embeddings on the first stage,
    some blocks, the final norm and the output head on the last. Submodules are the whole
    model's own (so are parameter names); the first stage takes token ids, the others the
    previous stage's hidden states; the last returns logits."""

    family = "gpt"

    def __init__(self, model: nn.Module, layers: Sequence[int], first: bool, last: bool) -> None:
        super().__init__()
        whole: Any = model
        self.cfg = whole.cfg
        self.emb: nn.Module | None = whole.emb if first else None
        self.blocks = nn.ModuleDict({str(i): whole.blocks[i] for i in layers})
        self.norm: nn.Module | None = whole.norm if last else None
        self.lm_head: nn.Module | None = whole.lm_head if last else None
        # Seeded initialisation by parameter name, as the whole model does it (meta_init).
        self.init_parameter = model.init_parameter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.emb is not None:
            x = self.emb(x)
        for block in self.blocks.values():
            x = block(x)
        if self.lm_head is None or self.norm is None:
            return x
        logits: torch.Tensor = self.lm_head(self.norm(x))
        vocab = self.cfg.vocab_size
        return logits[..., :vocab] if self.cfg.padded_vocab != vocab else logits


STAGE_BUILDERS: dict[str, Callable[[nn.Module, Sequence[int], bool, bool], StagePart]] = {
    "gpt": GPTStage,
}
"""Model family -> the module holding a contiguous run of its blocks."""


def _n_blocks(model: nn.Module) -> int:
    return len(getattr(model, "blocks", ()))


def check_pipeline(model: nn.Module, world_size: int, cfg: ParallelConfig, batch: int) -> None:
    """Every reason the layout cannot be pipelined, checked on the meta model without a process
    group (the launcher runs it before any worker starts). `batch`: data.batch_size."""
    pp, v, m = cfg.pp, cfg.virtual_stages, microbatches(cfg)
    if pp == 1:
        if cfg.microbatches is not None or v != 1:
            raise ConfigError(
                "parallel.microbatches and parallel.virtual_stages apply to pipeline "
                "parallelism only; set parallel.pp > 1 or remove them."
            )
        return
    if world_size % (pp * cfg.tp):
        raise ConfigError(
            f"parallel.pp {pp} x parallel.tp {cfg.tp} does not divide the {world_size} "
            f"processes; start a multiple of {pp * cfg.tp} processes (--nproc) or change "
            "parallel.pp."
        )
    family = str(getattr(model, "family", None))
    if family not in STAGE_BUILDERS:
        raise ConfigError(
            f"parallel.pp {pp} needs a model made of a sequence of blocks that hpcml can split "
            f"into stages ({', '.join(STAGE_BUILDERS)}); this model is not one, so set "
            "parallel.pp=1."
        )
    n_stages, n_blocks = pp * v, _n_blocks(model)
    if n_blocks % n_stages:
        raise ConfigError(
            f"parallel.pp {pp} x parallel.virtual_stages {v} = {n_stages} stages do not divide "
            f"the model's {n_blocks} blocks (model.args.n_layer); choose a pp (or n_layer) so "
            "that every stage gets the same number of blocks."
        )
    if getattr(model.cfg, "tie_embeddings", False):
        raise ConfigError(
            f"parallel.pp {pp} puts the token embedding and the output head on different "
            "stages, so they cannot share one weight; set model.args.tie_embeddings=false."
        )
    if m < pp:
        raise ConfigError(
            f"parallel.microbatches {m} is fewer than parallel.pp {pp}: the pipeline would "
            f"never fill; set parallel.microbatches to at least {pp}."
        )
    if batch % m:
        raise ConfigError(
            f"data.batch_size {batch} does not split into parallel.microbatches {m} equal "
            "micro-batches; choose a batch size that is a multiple of it."
        )
    single = cfg.pp_schedule in SINGLE_STAGE
    if single and v != 1:
        raise ConfigError(
            f"parallel.virtual_stages {v} needs an interleaved schedule, and "
            f"parallel.pp_schedule {cfg.pp_schedule} runs one stage per process; set "
            "parallel.virtual_stages=1 or parallel.pp_schedule=interleaved_1f1b."
        )
    if not single and m % pp:
        raise ConfigError(
            f"parallel.pp_schedule {cfg.pp_schedule} runs micro-batches in rounds of pp, and "
            f"parallel.microbatches {m} is not a multiple of parallel.pp {pp}; choose a multiple."
        )
    if cfg.tp > 1 and cfg.sequence_parallel:
        raise ConfigError(
            f"parallel.sequence_parallel would send each stage's slice of the sequence to the "
            f"next stage, which parallel.pp {pp} does not do; set "
            "parallel.sequence_parallel=false."
        )
    if (world_size // (pp * cfg.tp) > 1 or cfg.tp > 1) and not single:
        raise ConfigError(
            f"parallel.pp_schedule {cfg.pp_schedule} runs several stages per process, which "
            f"parallel.pp {pp} combines with neither data-parallel replicas nor parallel.tp; "
            "use gpipe or 1f1b, or run one pipeline of pp processes."
        )
    replicas = world_size // (pp * cfg.tp)
    if replicas > 1 and cfg.strategy == "ddp" and m == pp:
        # Measured (torch 2.13, gloo, pp 2): pp2 x ddp2 at 2 micro-batches stops in its first
        # step in DDP's reducer ("rebuilt parameter indices size is not same as original
        # model parameters size", gpipe and 1f1b alike); at 3 and 4 it trains, 4 equal to one
        # process. Refused here rather than there.
        raise ConfigError(
            f"parallel.strategy ddp with parallel.pp {pp} and parallel.microbatches {m} fails "
            f"in DDP's reducer in its first step (torch {torch.__version__}); set "
            f"parallel.microbatches above {pp} or parallel.strategy=fsdp."
        )
    if replicas > 1 and cfg.strategy not in DATA_PARALLEL:
        raise ConfigError(
            f"parallel.strategy {cfg.strategy} shards the optimizer over every process, not "
            f"over the replicas of one stage; with parallel.pp {pp} use "
            f"{', '.join(DATA_PARALLEL)}."
        )


def stage_layers(n_blocks: int, n_stages: int, stage: int) -> range:
    per = n_blocks // n_stages
    return range(stage * per, (stage + 1) * per)


def split_model(model: nn.Module, rt: Runtime, cfg: ParallelConfig) -> StagePart:
    """This rank's part of `model` (built on meta, not yet materialised): the union of its
    stages (`pipeline_stages`, their indices; `pipeline_views`, the stages, which share the
    part's submodules). With one stage per rank the part is that stage."""
    n_stages = cfg.pp * cfg.virtual_stages
    mine = [rt.pp_rank + k * cfg.pp for k in range(cfg.virtual_stages)]
    n_blocks = _n_blocks(model)
    build = STAGE_BUILDERS[str(getattr(model, "family", None))]

    def stage(stages: list[int]) -> StagePart:
        layers = [i for s in stages for i in stage_layers(n_blocks, n_stages, s)]
        return build(model, layers, 0 in stages, n_stages - 1 in stages)

    part = stage(mine)
    part.pipeline_stages = mine
    part.pipeline_views = [part] if len(mine) == 1 else [stage([s]) for s in mine]
    return part


def pipeline_mesh(rt: Runtime) -> DeviceMesh:
    """The (pp, dp) device mesh, with a third dimension tp under parallel.tp, in the rank order
    of `Runtime` (pp outermost, tp innermost). Its "pp" slice is this rank's pipeline (one rank
    per stage, of its data-parallel replica and tensor-parallel rank), "dp" the replicas of its
    stage (DDP's group, FSDP's mesh) and "tp" its stage's tensor-parallel ranks. Every rank
    must call it (it creates every slice's process group)."""
    shape: tuple[int, ...] = (rt.pp, rt.dp_size)
    names: tuple[str, ...] = ("pp", "dp")
    if rt.tp > 1:
        shape, names = (*shape, rt.tp), (*names, "tp")
    return init_device_mesh(rt.device.type, shape, mesh_dim_names=names)


def process_groups(rt: Runtime) -> tuple[dist.ProcessGroup, DeviceMesh]:
    """This rank's pipeline group and the mesh it came from (`pipeline_mesh`)."""
    mesh = pipeline_mesh(rt)
    return mesh["pp"].get_group(), mesh


def build_schedule(
    part: StagePart,
    stage_module: nn.Module,
    rt: Runtime,
    cfg: ParallelConfig,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    group: dist.ProcessGroup,
) -> tuple[Any, StageClock]:
    """The schedule that runs this rank's stages, and the clock of their compute. `stage_module`
    is `part` or its data-parallel wrapper (DDP), which the pipeline stage reduces once per
    step. Gradients are not scaled by the schedule: `loss_fn` divides by the micro-batches
    (and accumulation) itself."""
    from torch.distributed import pipelining

    mine, views = part.pipeline_stages, part.pipeline_views
    modules = [stage_module] if len(views) == 1 else views
    n_stages = cfg.pp * cfg.virtual_stages
    stages = [
        pipelining.PipelineStage(module, index, n_stages, rt.device, group=group)
        for module, index in zip(modules, mine, strict=True)
    ]
    clock = part.pipeline_clock = StageClock(stages)
    schedule_class = getattr(pipelining, SCHEDULES[cfg.pp_schedule])
    run = stages[0] if cfg.pp_schedule in SINGLE_STAGE else stages
    timed_loss = clock.timed_loss(loss_fn)
    return schedule_class(run, microbatches(cfg), loss_fn=timed_loss, scale_grads=False), clock


def forward_modules(model: nn.Module) -> list[nn.Module]:
    """The modules whose forward runs on each micro-batch: under `parallel.pp` this rank's
    stages (with several stages per rank the schedule calls each stage, never the part that
    holds them), otherwise `model` itself. Forward hooks go on these."""
    views = getattr(model, "pipeline_views", None)
    return list(views) if views else [model]


def is_first(part: StagePart) -> bool:
    return 0 in part.pipeline_stages


def is_last(part: StagePart, cfg: ParallelConfig) -> bool:
    return cfg.pp * cfg.virtual_stages - 1 in part.pipeline_stages


@torch.no_grad()
def forward_only(
    part: StagePart, x: torch.Tensor, rt: Runtime, cfg: ParallelConfig, group: dist.ProcessGroup
) -> torch.Tensor | None:
    """One forward of the whole batch `x` (token ids, which every rank of the pipeline holds)
    through the pipeline, stage after stage (evaluation: no micro-batches, any batch size).
    Returns the logits on the last stage's rank, None on the others."""
    n_stages = cfg.pp * cfg.virtual_stages
    views = dict(zip(part.pipeline_stages, part.pipeline_views, strict=True))
    for s in sorted(views):
        h = x
        if s > 0:  # the previous stage's hidden states, from the rank that holds it
            h = torch.empty((*x.shape, part.cfg.d_model), dtype=torch.float32, device=rt.device)
            dist.recv(h, group=group, group_src=(s - 1) % cfg.pp)
        out = views[s](h)
        if s == n_stages - 1:
            return out  # type: ignore[no-any-return]
        dist.send(out.float().contiguous(), group=group, group_dst=(s + 1) % cfg.pp)
    return None


def gather_state_dict(part: nn.Module, rt: Runtime) -> dict[str, torch.Tensor]:
    """The whole model's state dict on rank 0 (CPU tensors), from the stages of the first
    data-parallel replica's first tensor-parallel rank; an empty dict on the other ranks.
    Every rank must call it."""
    # FSDP and TP shards are gathered within each stage (a collective of its dp and tp ranks).
    whole = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
        for k, v in part.state_dict().items()
    }
    first_replica = rt.dp_rank == 0 and rt.rank % rt.tp == 0
    local = whole if first_replica else {}
    pieces: list[Any] = [None] * rt.world_size if rt.is_main else []
    dist.gather_object(local, pieces if rt.is_main else None, dst=0)
    if not rt.is_main:
        return {}
    merged: dict[str, torch.Tensor] = {}
    for piece in pieces:
        merged.update(piece)
    return merged


def _gather(obj: Any, part: nn.Module) -> list[Any] | None:
    """`obj` of every stage of this rank's pipeline, in stage order; None without pipelining."""
    group = getattr(part, "pipeline_group", None)
    if group is None:
        return None
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def keys_of_other_stages(part: nn.Module, keys: list[str]) -> set[str]:
    """The checkpoint keys the other stages of this pipeline expect (empty without one)."""
    every = _gather(keys, part)
    return {k for stage in every or [] for k in stage} - set(keys)
