"""What a finished run writes: the summary.json record (memory per rank, throughput, final
metrics, environment) and the model export. Every rank calls `build_summary` (gathering shards
and per-rank memory are collectives); rank 0 gets the record, the others an empty dict."""

from __future__ import annotations

import os
import platform
import random
import resource
from typing import Any

import numpy as np
import torch

from hpcml import __version__
from hpcml.data.drift import REFERENCE_FILE, profile_dataset
from hpcml.distributed.parallel import full_state_dict, local_state_bytes, unwrap
from hpcml.distributed.pipeline import gather_state_dict
from hpcml.distributed.runtime import all_gather_object, device_info
from hpcml.errors import Preempted
from hpcml.models.export import save_export
from hpcml.train import finetune
from hpcml.train.memtrace import summary_trace


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
    else:
        torch.backends.cudnn.benchmark = True


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def build_summary(t: Any) -> dict[str, Any]:
    """`t` is the Trainer at its end."""
    cfg, rt, res = t.cfg, t.rt, t.resolved
    memory: dict[str, Any] = local_state_bytes(unwrap(t.model), t.optimizer)
    memory.update(t.device_peaks.result())  # training steps' peak, evaluation's apart
    setup_memory = getattr(t, "setup_memory", None)
    memory["peak_rss_bytes"] = (
        setup_memory.process_peak_bytes() if setup_memory is not None else peak_rss_bytes()
    )
    memory.update(getattr(t, "setup_rss", {}))  # setup_peak_rss_bytes, setup_rss_growth_bytes
    memory.update(t.probe.result(rt.device))  # saved activations of the sampled forward
    memory.update(t.step_peak.result())  # a step's live tensor bytes at their peak (CPU)
    per_rank = all_gather_object(rt, memory)
    pipe = getattr(t, "pipeline", None)  # parallel.pp: the bubble, measured (a collective)
    pipeline = pipe.summary_block() if pipe is not None else None
    if cfg.parallel.pp > 1:  # every stage's part, sent to rank 0
        weights = gather_state_dict(unwrap(t.model), rt)
    else:  # a collective: every rank gathers its shards
        weights = full_state_dict(t.model)
    if not rt.is_main:
        return {}
    tuned, weights = weights, finetune.export_weights(cfg, res, weights)  # LoRA: merged
    splits = res.splits
    summary = {
        "status": "finished",
        "run_dir": str(t.out_dir),
        "steps": t.step,
        "world_size": rt.world_size,
        "device": device_info(rt),
        "precision": cfg.precision,
        "global_batch": t.global_batch,
        "model": {
            "name": cfg.model.name,
            "args": res.model_args,
            "input_shape": list(res.splits.input_shape),  # the planner's zoo CNN table: 3x32x32
            "parameters": t.n_params,
            "forward_flops_per_sample": t.flops_per_sample,
            "train_flops_per_sample": t.meter.workload.train_flops_per_sample,
        },
        "data": {
            "source": cfg.data.source,
            "fingerprint": splits.fingerprint,
            "version": splits.version,
            "versions_read": t.data_versions,
            "train_samples": len(splits.train),
            "val_samples": len(splits.val),
            "epochs_seen": t.train_data.epoch,
        },
        "memory": {**memory, "per_rank": per_rank},
        "throughput": t.meter.throughput(),
        "final": {**(t.last_eval or {}), "train_loss": t.meter.last_loss},
        "fault": t.guard.summary(),
        "resumed_from": str(t.resume_from) if t.resume_from else None,
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "hpcml": __version__,
            "hostname": platform.node(),
            "platform": platform.platform(),
        },
        "config": cfg.model_dump(mode="json"),
        "provenance": t.provenance,
        "finetune": finetune.summary_block(cfg, unwrap(t.model), res),
        "eval_sets": t.eval_sets.summary_block(t.last_eval, t.step),
    }
    if pipeline is not None:
        summary["pipeline"] = pipeline
    if t.privacy is not None:  # privacy.dp_sgd: the epsilon spent over the whole run
        summary["privacy"] = t.privacy.summary(t.step)
    # plan memory --trace of the run's own config (train.plan_trace)
    traced = summary_trace(cfg, res, rt.world_size)
    if traced is not None:
        summary["memory_trace"] = traced
    export = save_export(
        t.out_dir / "export",
        unwrap(t.model),
        cfg.model.name,
        res.model_args,
        splits.input_shape,
        (*splits.target_shape, splits.num_classes),
        input_dtype=splits.input_dtype,
        task=t.spec.task,
        state=weights,
        key=t.seal_key,
        metadata={
            "data": cfg.data.model_dump(mode="json"),
            "data_version": splits.version,
            "data_versions_read": t.data_versions,
            "run_dir": str(t.out_dir),
            "final": summary["final"],
            "step": t.step,
        },
    )
    finetune.write_adapter(export, cfg, res, tuned)  # finetune.export_adapter
    # The drift reference: seeded training inputs (one pass of __getitem__ over them).
    profile_dataset(
        splits.train,
        cfg.data.drift_reference_samples,
        seed=cfg.train.seed,
        prepare=splits.device_normalize,
        token_ids=splits.input_dtype == "int64",
    ).save(export / REFERENCE_FILE)
    return summary


def failure_kind(exc: BaseException) -> str:
    """ "preempted" only with the checkpoint saved for it; Ctrl-C is "interrupted" (exit 130)."""
    if isinstance(exc, Preempted):
        return "preempted"
    return "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"


def failure_summary(
    kind: str, exc: BaseException, out_dir: Any, provenance: dict[str, Any] | None = None
) -> dict[str, Any]:
    """What summary.json says of a run that had started writing and then ended early: how it
    ended and, when set-up got that far, the same provenance a finished run records (the code,
    config hash, data fingerprint and packages that produced its checkpoints)."""
    return {
        "status": kind,
        "error": f"{type(exc).__name__}: {exc}"[:500],
        "run_dir": str(out_dir),
        "checkpoint": getattr(exc, "checkpoint", None),
        "provenance": provenance or None,
    }
