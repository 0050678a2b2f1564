"""The one `RunConfig` tree: pydantic schemas, YAML loading and dotted command-line overrides.

Unknown keys, wrong types and bad values become a `ConfigError` with one sentence naming the
key, the value and what is allowed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from hpcml.config_sections import (  # re-exported: every section from hpcml.config
    SECONDS_MAX,
    EncryptionConfig,
    FaultConfig,
    ObserveConfig,
    PrivacyConfig,
    TrackingConfig,
    _Section,
    check_ac_policy,
)
from hpcml.errors import ConfigError

Positive = Annotated[int, Field(gt=0)]
Fraction = Annotated[float, Field(ge=0, lt=1)]
AreaShare = Annotated[float, Field(gt=0, le=1)]


class ModelConfig(_Section):
    name: str = "simple_cnn"
    """A zoo name (`hpcml model list`) or an import path `mypkg.models:build`."""
    args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments passed to the model builder."""
    init_from: str | None = None
    """Start from the weights of a full export (a run folder, its `export/` folder or the
    `model.safetensors` in it) instead of a fresh initialisation: fine-tuning. Each rank reads
    only its shards. A registry URI (`models:/NAME@ALIAS` or `models:/NAME/VERSION`, in the
    registry `tracking.uri` names) starts from that registered version's export, its files
    checked against the sha256 recorded at registration."""


class MixSource(_Section):
    path: str
    """A shard set: a folder written by `hpcml data shard`, or an s3:// URL holding one."""
    weight: float = Field(gt=0)
    """Its share of each epoch's samples: weight / the sum of the weights."""


class DataConfig(_Section):
    source: str = "digits"
    """`digits`, `cifar10`, `synthetic`, `tokens`, `shards` (and sources later issues add)."""
    path: str | None = None
    """Folder for file-backed sources (cifar10: the `cifar-10-batches-py` folder or its parent;
    shards: a folder written by `hpcml data shard`)."""
    batch_size: int = Field(64, gt=0)
    """Samples per process per micro-batch."""
    val_fraction: float = Field(0.2, ge=0.0, lt=1.0)
    """Share held out for validation when the source has no official split."""
    num_workers: int = Field(0, ge=0)
    """Loader worker processes per training process for the training data; 0 loads batches in
    the training process itself. Validation always loads in-process. A resume may change it."""
    pin_memory: bool = True
    """Put training and validation batches in page-locked host memory, so their copy to the GPU
    can overlap compute. Used on CUDA devices only; ignored on CPU runs."""
    persistent_workers: bool = True
    """With `num_workers` > 0: keep the loader workers alive from one epoch to the next instead
    of starting new ones each epoch; no effect with 0 workers."""
    prefetch_factor: int | None = Field(None, gt=0)
    """With `num_workers` > 0: batches each worker loads ahead; null uses PyTorch's default (2).
    No effect with 0 workers."""
    shuffle: bool = True
    """Visit the training samples in a new random order each epoch (from `train.seed` and the
    epoch); false keeps dataset order. Ignored by data.source tokens (random windows)."""
    synthetic_samples: int = Field(4096, gt=0)
    """data.source synthetic: samples generated in all, split into training and validation by
    `val_fraction` (0 still holds out 10%)."""
    synthetic_shape: list[Positive] = Field(default_factory=lambda: [3, 32, 32], min_length=1)
    """data.source synthetic: shape of one input without the batch dimension, e.g. `[3, 32, 32]`
    (channels, height, width), each size at least 1; values are standard normal, the same
    whatever `train.seed`. The whole set (`synthetic_samples` x this) must fit in this machine's
    memory twice (generated, then split)."""
    synthetic_classes: int = Field(10, gt=1)
    """data.source synthetic: number of classes; labels are drawn uniformly from 0 to this - 1.
    Zoo models that take `num_classes` are sized to match."""
    augment: bool = False
    """Random crop + horizontal flip on image training data."""
    augment_on: Literal["cpu", "device"] = "cpu"
    """Where data.augment runs: `cpu` (per sample, in the loader) or `device` (the whole batch
    after its transfer to the training device, `hpcml.data.device_augment`)."""
    mixup_alpha: float = Field(0.0, ge=0)
    """With augment_on: device, mixup with lambda ~ Beta(alpha, alpha); 0 turns it off."""
    cutmix_alpha: float = Field(0.0, ge=0)
    """With augment_on: device, cutmix with lambda ~ Beta(alpha, alpha); 0 turns it off. With
    both alphas set, each batch gets one of the two, evenly."""
    random_resized_crop: tuple[AreaShare, AreaShare] | None = None
    """data.source shards of encoded images (`hpcml data shard FOLDER --encoded`): each
    training image is decoded at its stored resolution, a random crop covering this range of
    its area (e.g. `[0.08, 1.0]`, ImageNet's) with an aspect ratio from 3/4 to 4/3 is taken
    from it and resized to the set's image size, in the loader workers (the algorithm of
    torchvision's RandomResizedCrop, drawn from (`train.seed`, epoch, sample)). null: the whole
    image resized. Validation images are always resized whole."""
    limit_train: int | None = Field(None, gt=0)
    """Use only the first N training samples (smoke tests)."""
    seq_len: int = Field(256, gt=0)
    """Tokens per training window (data.source tokens); the model's context is set to match."""
    eval_windows: int | None = Field(256, gt=0)
    """Validation windows, evenly spaced through the validation tokens; null means all of them."""
    vocab_size: int | None = Field(None, gt=1)
    """Token vocabulary; null reads it from meta.json beside the token files."""
    shard_cache: int = Field(4, gt=0)
    """data.source shards: shard files each reading process keeps open (memory-mapped); bounds
    its memory to about this many shards whatever the size of the shard set."""
    cache_dir: str | None = None
    """data.source shards in a bucket: a local folder where downloaded shards are kept (in its
    subfolder `hpcml-shard-cache`, which the cache owns: named by their sha256, written
    atomically, shared by the processes of a host; other files in the folder are never touched)
    and memory-mapped from; null downloads a shard each time a process needs it again."""
    cache_limit_gb: float = Field(10.0, gt=0)
    """data.cache_dir: bytes (in GB, 10^9) the cached shards may take; least recently used
    ones (only files the cache wrote) are deleted above it."""
    allow_change: bool = False
    """Resuming onto a shard set of another version than the checkpoint's (`hpcml train
    --allow-data-change` sets it): false refuses in one sentence; true continues and records
    every version read, in order (summary.json, the export's model.json, MLflow)."""
    verify: Literal["full", "size", "none"] = "full"
    """data.source shards, checked before training: `full` every shard's size and sha256 (a
    local folder's hashing split over the ranks, each hashing its share once, and remembered
    between runs while a file's size, times and inode are unchanged; a bucket's shards are
    hashed when read), and each local shard's rows; `size` sizes and rows only; `none` nothing
    before training (each shard's rows, and a remote one's sha256, are still checked when
    read)."""
    mix: list[MixSource] | None = None
    """data.source shards: several shard sets read as one, `[{path: A, weight: 3}, {path: B,
    weight: 1}]` (data.path unset). Each epoch has as many samples as the sets together, drawn
    from each set in proportion to its weight (a set with fewer samples than its share is
    repeated, in a new order each pass; one with more gives another random part each epoch),
    interleaved by a seeded draw that keeps each set's own order, all from (`train.seed`,
    epoch): deterministic and elastic like one set. The sets must have the same sample spec
    and classes; validation is every set's validation split."""
    shuffle_shards: int | None = Field(None, ge=1)
    """data.source shards with data.shuffle: shards an epoch's order mixes at a time. The shard
    order is shuffled, then the samples of each run of this many shards, both from
    (`train.seed`, epoch), so a reading process needs only this many shards at once and reads
    each once per epoch. null: all of them (one permutation over every sample: the best mix,
    but any batch may need any shard) for a local folder; data.shard_cache - 1 (at least 1)
    for a set in a bucket, where a shard that left the cache is downloaded again."""
    readahead: int | None = Field(None, ge=0)
    """data.source shards: shards fetched ahead in a background thread while the current one is
    read (within data.shard_cache); null means 1 for a set in a bucket, 0 for a local folder."""
    drift_reference_samples: int = Field(10_000, ge=1)
    """Training inputs (drawn with train.seed, all of them when the set is smaller) profiled into
    the export's drift reference (`reference_profile.json`); an image keeps 64 pixels per
    channel of each. Serving tests its live window against it."""


class OptimConfig(_Section):
    name: Literal["adamw", "sgd"] = "adamw"
    """`adamw` (torch.optim.AdamW: uses `betas`, `eps`) or `sgd` (torch.optim.SGD: uses
    `momentum`), with the fused kernel where the parameters allow it."""
    lr: float = Field(1e-3, gt=0)
    """Peak learning rate, reached at the end of the warmup and then shaped by `schedule`;
    multiplied by the number of data-parallel processes with `scale_lr_with_world`."""
    weight_decay: float = Field(0.0, ge=0)
    """Weight decay coefficient: decoupled for `adamw`, an L2 term added to the gradient for
    `sgd`; 0 turns it off. Norms, biases and embeddings are exempt unless
    `decay_norms_biases_embeddings`."""
    decay_norms_biases_embeddings: bool = False
    """With weight_decay > 0: also decay norm weights, biases and embedding tables (by default
    they form a parameter group without decay, as in GPT-3 and LLaMA training)."""
    momentum: float = Field(0.9, ge=0, lt=1)
    """`sgd` only: momentum factor (0 is plain SGD); `adamw` ignores it."""
    betas: tuple[Fraction, Fraction] = (0.9, 0.999)
    """`adamw` only: decay rates of the running averages of the gradient and of its square,
    each from 0 up to but not including 1 (as torch.optim.AdamW requires); `sgd` ignores them."""
    eps: float = Field(1e-8, gt=0)
    """`adamw` only: term added to the denominator for numerical stability; `sgd` ignores it."""
    grad_clip: float | None = Field(None, gt=0)
    """Clip the global gradient norm to this value; null turns clipping off."""
    warmup_steps: int = Field(0, ge=0)
    """Optimizer steps over which the LR rises linearly to `lr` (the first step uses
    lr / warmup_steps), whatever the schedule; 0: no warmup."""
    schedule: Literal["cosine", "constant", "linear"] = "cosine"
    """LR after the warmup: `cosine` (half a cosine) or `linear` decay to lr x `min_lr_ratio`
    at step `decay_steps` (else train.max_steps), held there after it; `constant` keeps lr."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Where `cosine` and `linear` decay end, as a fraction of lr: 0 decays to zero, 1 does not
    decay. `constant` ignores it."""
    decay_steps: int | None = Field(None, gt=0)
    """The step at which the LR decay ends (it runs from the end of warmup to this step, so
    warmup counts within it); null means train.max_steps."""
    scale_lr_with_world: bool = False
    """Linear scaling rule: multiply lr by the number of data-parallel processes (the world
    size divided by parallel.tp; Goyal et al. 2017)."""


class ProfileConfig(_Section):
    """torch.profiler schedule: skip `wait` steps, warm up `warmup`, record `active`."""

    wait: int = Field(2, ge=0)
    """Optimizer steps, from the start (or resume) of the process, before the profiler starts."""
    warmup: int = Field(1, ge=0)
    """Steps then run under the profiler without being recorded (its start-up cost)."""
    active: int = Field(3, gt=0)
    """Steps recorded; once they are done the trace and breakdown are written, and profiling
    stops (it runs once)."""


class TrainConfig(_Section):
    max_steps: int = Field(300, gt=0)
    """Optimizer steps to train for, counted from step 0 (a resumed run continues up to it);
    also the LR schedule's horizon unless `optim.decay_steps` is set."""
    eval_every: int = Field(100, ge=0)
    """Evaluate every N steps (and at the end); 0 evaluates at the end only."""
    eval_batch_size: int | None = Field(None, gt=0)
    """Samples per evaluation batch on each data-parallel rank; null: 2 x data.batch_size."""
    checkpoint_every: int = Field(0, ge=0)
    """Checkpoint every N steps (and at the end); 0 checkpoints at the end only."""
    checkpoint_every_s: float | None = Field(None, gt=0, le=SECONDS_MAX)  # [fault] issue 11
    """Also checkpoint when this many seconds passed since the last save (the ranks agree on
    it every 10 steps); null turns time-based checkpoints off."""
    keep_last: int = Field(3, gt=0)
    """Complete checkpoints kept in RUN_DIR/checkpoints/; older ones are deleted after each save."""
    grad_accum: int = Field(1, gt=0)
    """Micro-batches of `data.batch_size` per optimizer step; their gradients are averaged and
    reduced across processes only on the last one. Derived from `global_batch` when set."""
    global_batch: int | None = Field(None, gt=0)
    """Samples per optimizer step over all processes. When set, grad_accum is derived from it:
    global_batch / (data.batch_size x data-parallel processes), which must be a whole number;
    a resume on another number of processes then keeps the same optimization."""
    seed: int = Field(0, ge=0, le=2**32 - 1)
    """Seeds Python, NumPy and torch, the initial weights, the training data order,
    augmentation and (offset by the rank) dropout. NumPy's seeding takes 0 to 2^32 - 1."""
    deterministic: bool = False
    """torch.use_deterministic_algorithms (warn only: an op without a deterministic version
    warns and runs), cuDNN autotuning off, CUBLAS_WORKSPACE_CONFIG set if unset; false lets
    cuDNN autotune."""
    log_every: int = Field(10, gt=0)
    """Flush step records (and the progress line) every N steps; each step still gets a record."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """`auto`: a CUDA device when one is visible (local rank modulo the device count), else the
    CPU; `cuda` fails when none is visible; `cpu` never uses a GPU."""
    channels_last: bool = False
    """Store the model and 4-D input batches (images) in the channels-last memory format (NHWC),
    in training and evaluation; other inputs are left as they are."""
    activation_checkpointing: str = "none"
    """Recompute activations in backward, by the names `hpcml plan --recompute` takes
    (hpcml.plan.recompute): `full` (every block), `op` (torchtitan's selective op
    checkpointing: each block saves its attention kernel's and every other matmul's outputs),
    `layer:K` (every K-th block in full, from the first), `none`; `selective` is the older name
    of `layer:K` with K = `ac_every`. `attention-scores` is refused: the zoo's attention is
    fused (SDPA) and keeps no scores to drop."""
    ac_every: int = Field(2, gt=0)
    """With activation_checkpointing `selective`: recompute every N-th block (the first, the
    N+1-th, ...); 1 recomputes all. Ignored by the other policies."""
    plan_trace: Literal["auto", "always", "never"] = "auto"
    """Trace one step of the run's own config on fake tensors at its end (as `hpcml plan memory
    --trace` does) so that summary.json's prediction takes its activations (and, for one
    process or ddp, its peak) from it: `auto` takes the trace from the per-user cache
    (`$HPCML_CACHE_DIR`, else `~/.cache/hpcml`) when the same step was traced before, else
    traces it and stores it; `always` traces afresh; `never` traces nothing. On the CPU,
    anything but `never` also traces the run's own third step as it runs (live tensor bytes
    at their peak, summary.json's `traced_peak_bytes`), which `plan check` compares with the
    predicted peak."""
    compile: bool = False
    """torch.compile each block (or the whole model when it has no blocks)."""
    eval_sets: dict[str, str] | None = None
    """Named evaluation sets besides data.path's validation split, `{old: data/a, new:
    data/b}`: each a data path of the same data.source, whose validation split every
    evaluation also scores (`NAME/val_loss`, `NAME/val_accuracy`); a fresh run scores them
    before its first step too, and summary.json's `eval_sets` gives each set's scores before
    and after and its forgetting (continual learning; hpcml.train.eval_sets)."""
    peak_flops: float | None = Field(None, gt=0)
    """Peak FLOP/s of one device for the precision in use, for MFU; null looks it up by name."""
    loss: str = "cross_entropy"
    """`cross_entropy` or an import path `pkg.mod:fn` to fn(logits, target) -> mean loss."""

    profile: ProfileConfig | None = None
    """Profile a few steps (torch.profiler): RUN_DIR/profile/ gets a Chrome trace and a
    breakdown of step time per rank; null: off."""
    checkpoint_async: bool = False
    """Write checkpoints in the background (torch.distributed.checkpoint.async_save): training
    stalls only for the copy to host memory, but the write then shares the host's cores with
    training (the fault-tolerance guide: when it pays)."""
    checkpoint_writer_nice: int = Field(0, ge=0, le=19)
    """With checkpoint_async: raise the background writer thread's nice value by this much
    (Linux; capped at 19) so that it runs on the cycles training leaves. 0 runs it at
    training's priority: on 2 CPU cores a lowered writer added more loop time, not less, and
    took about 10x longer to make a checkpoint durable (benchmarks/checkpoint_stall.py)."""

    @field_validator("activation_checkpointing")
    @classmethod
    def _ac_policy(cls, value: str) -> str:
        return check_ac_policy(value)


class ParallelConfig(_Section):
    strategy: Literal["ddp", "zero1", "zero2", "zero3", "fsdp"] = "ddp"
    """ddp replicates everything; zero1 shards optimizer state (ZeroRedundancyOptimizer under
    DDP); zero2 shards optimizer state and gradients and keeps parameters gathered between
    forward and backward (FSDP2); zero3 = fsdp shards parameters too (FSDP2)."""
    tp: int = Field(1, gt=0)
    """Tensor-parallel degree (gpt models); the data-parallel degree is world_size / (tp x pp)."""
    pp: int = Field(1, gt=0)
    """Pipeline-parallel degree (gpt models): the blocks are split into pp stages, one per group
    of world_size / pp processes (`torch.distributed.pipelining`); the data-parallel degree is
    world_size / (pp x tp). Each stage is replicated over its data-parallel processes by
    `strategy` (FSDP2 under zero2, zero3, fsdp; ddp, refused with microbatches equal to pp, at
    which it failed in DDP's reducer under torch 2.13; not zero1) and split over tp processes
    by the model's tensor-parallel plan (not with sequence_parallel); with either, pp_schedule
    is gpipe or 1f1b."""
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"] = "1f1b"
    """With pp > 1: the order in which a stage runs its micro-batches' forwards and backwards
    (GPipe: all forwards, then all backwards; 1F1B: one forward, one backward once the pipeline
    is full, holding at most pp micro-batches' activations)."""
    microbatches: int | None = Field(None, gt=0)
    """With pp > 1: the micro-batches each data.batch_size batch is split into (at least pp;
    null: pp). More micro-batches leave stages idle for a smaller share of the step, a bubble
    of (pp - 1) / (microbatches + pp - 1) for gpipe and 1f1b."""
    virtual_stages: int = Field(1, gt=0)
    """With pp > 1: stages per process (interleaved schedules)."""
    sequence_parallel: bool = False
    """With tp > 1, also split norms and dropout along the sequence (Korthikanti et al. 2022)."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend when there is more than one process: `auto` picks `nccl` on
    CUDA devices and `gloo` on the CPU."""
    find_unused_parameters: bool = False
    """DDP's option, for models where some parameters get no gradient in a step; costs a pass
    over the autograd graph each step. ddp and zero1 with several data-parallel processes only."""
    bucket_cap_mb: float = Field(25.0, gt=0, le=2**43)  # DDP's bytes are a C++ int64
    """DDP gradient bucket size in MiB: gradients are all-reduced bucket by bucket during
    backward; 25 is torch's default. ddp and zero1 with several data-parallel processes only."""
    sync_batchnorm: bool = False
    """Convert BatchNorm layers to SyncBatchNorm, so batch statistics span all data-parallel
    processes. ddp and zero1 with several data-parallel processes only."""
    timeout_s: float = Field(600.0, gt=0, le=SECONDS_MAX)
    """Collective timeout; a rank that stops answering fails the job after this long."""
    accum_reduce: Literal["step", "micro_batch"] = "step"
    """With train.grad_accum > 1 under zero2/zero3/fsdp: `step` keeps each rank's unsharded
    gradients through the accumulation and reduce-scatters once per step (the least traffic);
    `micro_batch` reduce-scatters after every micro-batch and accumulates sharded gradients
    (1/dp of the gradient memory, grad_accum times the reduce-scatter traffic; what torchtitan
    does), for models whose full gradients do not fit beside the rest. ddp and zero1 reduce
    once per step either way."""


class FinetuneConfig(_Section):
    """Fine-tuning from `model.init_from` (hpcml.train.finetune; LoRA by Hugging Face PEFT)."""

    method: Literal["full", "lora", "last_layer"] = "full"
    """`full` trains every parameter; `lora` freezes the base and trains low-rank adapters on
    the `target` modules; `last_layer` trains only the output layer."""
    r: int = Field(8, gt=0)
    """LoRA rank."""
    alpha: float = Field(16.0, gt=0)
    """LoRA scaling numerator: the adapter's update is scaled by alpha / r."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input (training only)."""
    target: list[str] | None = None
    """Module names (a name matches when it is the module's full name or its last part) that
    get adapters; null: the attention projections wq, wk, wv, wo of a gpt, every Linear and
    Conv2d of other models."""
    export_adapter: bool = False
    """With lora: also write the adapter alone (PEFT's safetensors + config) to export/adapter."""
    base_dtype: Literal["fp32", "int8", "nf4"] = "fp32"
    """With lora: the frozen base's Linear weights as stored for training; `int8` keeps them
    as int8 with one fp32 scale per output row, `nf4` as QLoRA's 4-bit NormalFloat with one
    double-quantized scale per 64 weights (hpcml.models.quant), adapters in fp32. The export
    is merged into fp32 weights either way."""


class TuneParam(_Section):
    """One dimension of `tune.space`: a range (`float`, `int`) or a list of `choices`."""

    type: Literal["float", "int", "categorical"]
    """`float` or `int` between `low` and `high` (inclusive), or `categorical` from `choices`."""
    low: float | None = None
    """float, int: the smallest value (above 0 with `log`)."""
    high: float | None = None
    """float, int: the largest value; above `low`."""
    log: bool = False
    """float, int: sample on a log scale (learning rates, weight decay)."""
    step: float | None = Field(None, gt=0)
    """float, int: values on a grid `low + k * step`; the grid sampler needs it for a float."""
    choices: list[bool | int | float | str] | None = None
    """categorical: the values to choose from (numbers, strings, booleans)."""


class TuneConfig(_Section):
    """`hpcml tune`: an Optuna study whose trials are `hpcml train` runs (hpcml.tune)."""

    metric: str = "val_accuracy"
    """The score each trial reports at every evaluation and is judged by: `val_accuracy`,
    `val_loss`, or a `train.eval_sets` set's `NAME/val_accuracy` or `NAME/val_loss`."""
    direction: Literal["maximize", "minimize"] = "maximize"
    """Whether a larger or a smaller `metric` is better."""
    sampler: Literal["tpe", "random", "grid", "cmaes", "qmc"] = "tpe"
    """Optuna's sampler: `tpe`, `random`, `grid` (every combination of the space), `cmaes` or
    `qmc` (Sobol)."""
    pruner: Literal["asha", "hyperband", "median", "none"] = "asha"
    """Stops trials early from their evaluations: `asha` (successive halving), `hyperband`,
    `median` or `none`, from `first_rung` on."""
    first_rung: int | None = Field(None, gt=0)
    """First step at which a trial may be pruned (`asha`'s and `hyperband`'s first rung); null:
    the first evaluation after the longest `optim.warmup_steps` the space allows (a trial still
    warming up looks worse than it is)."""
    reduction_factor: int | None = Field(None, ge=2)
    """`asha`, `hyperband`: each rung is this many times the step of the one before, and keeps
    1 in this many trials; null: 3, or 2 where 3 leaves one rung that acts (at an evaluation)
    before the longest trial's end and 2 leaves more."""
    startup_trials: int | None = Field(None, ge=0)
    """`tpe`, `cmaes`: random trials before the sampler models the space; null: Optuna's."""
    space: dict[str, TuneParam] = Field(default_factory=dict)
    """Dotted config key (e.g. `optim.lr`) -> its distribution."""
    trials: int = Field(20, gt=0)
    """Trials the study holds when done; `--trials` overrides it."""
    timeout_s: float | None = Field(None, gt=0)
    """Start no trial after this many seconds of this invocation; null: no limit."""
    step_budget: int | None = Field(None, gt=0)
    """Training steps the study's trials may take in all: a trial starts only if a full run fits
    in what is left (a pruned trial gives back the steps it did not run); null: no limit."""
    sample_budget: int | None = Field(None, gt=0)
    """Training samples the study's trials may take in all (each step counts its global batch:
    `data.batch_size` x `train.grad_accum` x data-parallel processes, or `train.global_batch`),
    the fairer budget when the space searches the batch size; a trial starts only if the
    largest run the space allows fits in what is left; null: no limit."""
    seed: int = Field(0, ge=0, le=2**32 - 1)
    """Seed of the sampler (each worker's is offset from it, wrapping at 2^32)."""
    device: str | None = None
    """Hardware catalog key (`hpcml plan hardware`) of the device trials will train on: a
    trial the planner predicts will not fit its memory is recorded infeasible, never started."""
    catalog: list[str] = Field(default_factory=list)
    """Extra hardware catalog YAML files for `device` (as `hpcml plan --catalog`)."""


class RunConfig(_Section):
    model: ModelConfig = Field(default_factory=lambda: ModelConfig())
    data: DataConfig = Field(default_factory=lambda: DataConfig())
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig())
    train: TrainConfig = Field(default_factory=lambda: TrainConfig())
    precision: Literal["fp32", "tf32", "bf16", "fp16"] = "fp32"
    """`fp32` plain float32; `tf32` lets float32 matmuls and cuDNN convolutions on CUDA use
    TensorFloat-32; `bf16` or `fp16` autocast with fp32 parameters (and fp32 gradient reduction
    under FSDP). `fp16` adds a gradient scaler and is refused with parallel.tp > 1."""
    parallel: ParallelConfig = Field(default_factory=lambda: ParallelConfig())
    tracking: TrackingConfig = Field(default_factory=lambda: TrackingConfig())
    fault: FaultConfig = Field(default_factory=lambda: FaultConfig())
    observe: ObserveConfig = Field(default_factory=lambda: ObserveConfig())
    tune: TuneConfig | None = None
    """Hyperparameter search (`hpcml tune`); `hpcml train` ignores it."""
    finetune: FinetuneConfig = Field(default_factory=lambda: FinetuneConfig())
    encryption: EncryptionConfig = Field(default_factory=lambda: EncryptionConfig())
    privacy: PrivacyConfig = Field(default_factory=lambda: PrivacyConfig())

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        if self.train.eval_every and self.train.eval_every > self.train.max_steps:
            # Harmless, but say nothing: evaluation still happens at the end.
            pass
        return self


def _describe_allowed(model_cls: type[BaseModel]) -> str:
    return ", ".join(model_cls.model_fields)


def _section_class(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    cls: type[BaseModel] = RunConfig
    for part in loc:
        field = cls.model_fields.get(str(part))
        if field is None:
            return None
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            cls = ann
        else:
            return None
    return cls


def _format_validation_error(err: ValidationError, origin: str) -> str:
    e = err.errors()[0]
    loc = tuple(p for p in e["loc"] if not isinstance(p, int) or True)
    key = ".".join(str(p) for p in loc)
    value = e.get("input")
    if e["type"] == "extra_forbidden":
        parent = _section_class(loc[:-1])
        allowed = _describe_allowed(parent) if parent else "see the schema"
        where = ".".join(str(p) for p in loc[:-1]) or "the top level"
        return (
            f"config key '{key}' (from {origin}) is not known; keys allowed under {where} are: "
            f"{allowed}."
        )
    msg = e["msg"]
    if e["type"] == "literal_error":
        msg = msg.replace("Input should be", "allowed values are")
    return f"config key '{key}' has value {value!r} (from {origin}), which is not allowed: {msg}."


def parse_override(text: str) -> tuple[list[str], Any]:
    """`optim.lr=3e-4` -> (["optim", "lr"], 0.0003). Values are parsed as YAML scalars."""
    if "=" not in text:
        raise ConfigError(
            f"override '{text}' has no '='; write overrides as dotted.key=value, "
            "e.g. optim.lr=0.01."
        )
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not p for p in key.split(".")):
        raise ConfigError(f"override '{text}' has an empty key; write it as dotted.key=value.")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = {}
                node[part] = child
            if not isinstance(child, dict):
                raise ConfigError(
                    f"override '{text}' goes inside '{part}', which holds a value, not a section."
                )
            node = child
        node[path[-1]] = value
    return data


def load_yaml(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist; pass the path of a YAML config.")
    if path.is_dir():
        raise ConfigError(f"config path {path} is a folder; pass the path of a YAML config file.")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not UTF-8 text; pass a YAML config.") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"config file {path} is not valid YAML{where}; fix its syntax.") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections at the top level.")
    return data


def build_config(data: dict[str, Any], origin: str = "the config") -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, origin)) from None


def load_config(path: Path | str | None, overrides: list[str] | None = None) -> RunConfig:
    """Load a YAML config (or the embedded defaults when `path` is None) plus dotted overrides."""
    data: dict[str, Any] = load_yaml(Path(path)) if path is not None else {}
    overrides = overrides or []
    origin = str(path) if path is not None else "the defaults"
    if overrides:
        origin += " with overrides " + " ".join(overrides)
    return build_config(apply_overrides(data, overrides), origin)


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def flatten(cfg: RunConfig) -> dict[str, Any]:
    """Dotted key -> value, e.g. for tracking params."""
    out: dict[str, Any] = {}

    def walk(prefix: str, obj: Any) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            out[prefix] = obj

    walk("", cfg.model_dump(mode="json"))
    return out
