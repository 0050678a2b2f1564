"""Building the model a run trains: on the meta device, FLOPs counted there, parallelized
(TP, AC, compile, FSDP2), then only this rank's shards given storage and initialised, or loaded
from `model.init_from` (`hpcml.distributed.meta_init`). No rank ever holds the whole model
unless its strategy replicates it (ddp, zero1, one process).

A model that cannot be initialised after `to_empty` (a user module owning parameters without a
`reset_parameters`) is built on the CPU as before, with the seeded global RNG.

Set-up memory: `SetupMemory` resets the kernel's peak-RSS mark (`/proc/self/clear_refs`, Linux)
at the start of set-up, so the peak it reads at the end is the peak of set-up alone, and the
growth over the RSS at the start excludes what importing torch already cost.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hpcml.config import RunConfig
from hpcml.distributed import meta_init, pipeline
from hpcml.distributed.parallel import parallelize
from hpcml.distributed.runtime import Runtime
from hpcml.models.zoo import build_model, count_parameters, forward_flops_per_sample


@dataclass
class BuiltModel:
    model: nn.Module
    n_params: int
    flops_per_sample: int
    on_meta: bool
    """True when the model was built on meta and only local shards were materialized."""


def build_training_model(cfg: RunConfig, rt: Runtime, res: Any) -> BuiltModel:
    """`res` is the `hpcml.train.validate.Resolved` of this run."""
    if cfg.finetune.method != "full":  # frozen base from init_from + adapters (finetune.py)
        from hpcml.train.finetune import build_finetune_model

        return build_finetune_model(cfg, rt, res)  # type: ignore[no-any-return]
    splits, init_from = res.splits, res.init_from
    with torch.device("meta"):
        model = build_model(cfg.model.name, res.model_args)
    on_meta = meta_init.initializable(model)
    if not on_meta:
        model = build_model(cfg.model.name, res.model_args).to(rt.device)
    if cfg.train.channels_last:
        model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    n_params = count_parameters(model)
    # FlopCounterMode needs shapes only: on meta nothing is computed or allocated.
    flops = forward_flops_per_sample(
        model, splits.input_shape, splits.input_dtype, device="meta" if on_meta else rt.device
    )
    twins = meta_init.twins(model) if on_meta else {}

    def materialize(m: nn.Module) -> None:
        if on_meta:
            meta_init.materialize(m, rt.device, cfg.train.seed, twins, init_from)
        elif init_from is not None:
            meta_init.load_full_export(m, init_from)

    mesh = None
    if cfg.parallel.pp > 1:  # this rank's stages only, still on meta
        part = pipeline.split_model(model, rt, cfg.parallel)
        part.pipeline_group, mesh = pipeline.process_groups(rt)
        model = part
    # Our cross-entropy runs loss-parallel under TP; a user's train.loss gets whole logits, and
    # so does a pipeline's last stage (the schedule calls the loss without loss_parallel).
    loss_parallel = cfg.train.loss == "cross_entropy" and cfg.parallel.pp == 1
    # Under privacy.dp_sgd no DDP: Opacus's DP optimizer reduces the clipped, noisy gradients.
    model = parallelize(
        model, rt, cfg.parallel, cfg.train, cfg.precision, materialize, loss_parallel, mesh,
        data_parallel=cfg.privacy.dp_sgd is None,
    )  # fmt: skip
    return BuiltModel(model, n_params, flops, on_meta)


def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class SetupMemory:
    """Peak RSS of set-up and its growth over the RSS at the start of set-up."""

    def __init__(self) -> None:
        self.before_peak_bytes = _max_rss_bytes()  # the process's peak so far (imports ...)
        self.reset = False
        try:
            Path("/proc/self/clear_refs").write_text("5")  # "5": reset the peak-RSS mark
            self.reset = True
        except OSError:
            pass
        self.start_rss_bytes = _status_bytes("VmRSS") or _max_rss_bytes()
        self.before_model_rss_bytes: int | None = None

    def mark_model_start(self) -> None:
        """The RSS once the run is resolved (libraries imported, data opened), before the model
        is built: what a run's peak holds beyond it is the model, its training and its data."""
        self.before_model_rss_bytes = _status_bytes("VmRSS")

    def result(self) -> dict[str, int | None]:
        peak = _status_bytes("VmHWM") or _max_rss_bytes()
        return {
            "setup_start_rss_bytes": self.start_rss_bytes,
            "rss_before_model_bytes": self.before_model_rss_bytes,
            "setup_peak_rss_bytes": peak,
            # Without the reset the peak may predate set-up: then the growth is unknown.
            "setup_rss_growth_bytes": peak - self.start_rss_bytes if self.reset else None,
        }

    def process_peak_bytes(self) -> int:
        """The whole process's peak RSS, including what came before the reset."""
        return max(self.before_peak_bytes, _max_rss_bytes())
