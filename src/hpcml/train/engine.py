"""The training loop. Readable top to bottom: set up, (resume), step, evaluate, checkpoint,
export, summarize. Features hook in as named pieces (checkpoint, schedule, metrics, hooks)."""

from __future__ import annotations

import os
import platform
import random
import resource
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from hpcml import __version__
from hpcml.config import RunConfig, dump_config
from hpcml.data.loader import EpochLoader, eval_loader, shard_for_eval
from hpcml.data.sources import load_source
from hpcml.distributed.parallel import (
    clip_grad_norm,
    full_state_dict,
    grad_scaler,
    local_state_bytes,
    no_sync,
    parallelize,
    shard_optimizer,
    unwrap,
)
from hpcml.distributed.precision import setup_precision
from hpcml.distributed.runtime import (
    Runtime,
    all_gather_object,
    all_reduce_sum,
    broadcast_object,
    device_info,
    init_runtime,
    shutdown,
)
from hpcml.errors import HpcmlError, Preempted
from hpcml.models.export import save_export
from hpcml.models.zoo import (
    build_model,
    complete_args,
    count_parameters,
    forward_flops_per_sample,
    get_spec,
)
from hpcml.records import (
    CONFIG,
    RunLog,
    truncate_run_log_after,
    write_json_atomic,
    write_text_atomic,
)
from hpcml.track.provenance import collect as collect_provenance
from hpcml.train import checkpoint as ckpt
from hpcml.train import memprobe, mfu, rundir  # memprobe
from hpcml.train.fault import FaultGuard
from hpcml.train.hooks import Hooks
from hpcml.train.losses import cross_entropy
from hpcml.train.metrics import LiveView, StepMeter
from hpcml.train.schedule import build_optimizer, build_scheduler
from hpcml.train.tracking import TrackingHook


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


@torch.no_grad()
def evaluate(
    model: nn.Module, loader: Any, rt: Runtime, precision: Any, channels_last: bool
) -> dict[str, float]:
    """Loss and accuracy over the whole validation set, each rank on its shard, sums reduced."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=rt.device)  # loss sum, correct, count
    for x, y in loader:
        x = x.to(rt.device, non_blocking=True)
        y = y.to(rt.device, non_blocking=True)
        if channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        with precision.autocast():
            logits = model(x)
        totals[0] += cross_entropy(logits.float(), y, reduction="sum").double()
        totals[1] += (logits.argmax(dim=-1) == y).sum().double()
        totals[2] += y.numel()
    all_reduce_sum(rt, totals)
    totals /= rt.tp  # the ranks of one tensor-parallel group evaluate the same samples
    model.train(was_training)
    n = max(totals[2].item(), 1.0)
    return {
        "val_loss": totals[0].item() / n,
        "val_accuracy": totals[1].item() / n,
        "val_samples": int(totals[2].item()),
    }


def _prepare(
    cfg: RunConfig,
    rt: Runtime,
    run_dir: Path | None,
    config_path: Path | None,
    resume: str | None,
    overwrite: bool,
    view_warn: Any,
) -> tuple[Path, Path | None]:
    """Rank 0 checks and prepares the run folder; every rank gets the same answer or error."""
    answer: tuple[str, Any, Any] = ("ok", None, None)
    if rt.is_main:
        try:
            chosen = run_dir or rundir.default_run_dir(config_path)
            # A restarted elastic group resumes from the newest checkpoint, whatever was asked.
            if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
                resume, overwrite = "auto", False
            answer = ("ok", chosen, rundir.resolve(chosen, resume, overwrite, warn=view_warn))
        except HpcmlError as exc:
            answer = ("error", type(exc).__name__, exc.message)
    answer = broadcast_object(rt, answer)
    if answer[0] == "error":
        import hpcml.errors as errors

        raise getattr(errors, answer[1], HpcmlError)(answer[2])
    return Path(answer[1]), answer[2]


def run(
    cfg: RunConfig,
    run_dir: Path | None = None,
    resume: str | None = None,
    overwrite: bool = False,
    quiet: bool = False,
    config_path: Path | None = None,
    hooks: Hooks | None = None,
) -> dict[str, Any]:
    rt = init_runtime(
        cfg.train.device, cfg.parallel.backend, cfg.parallel.timeout_s, cfg.parallel.tp
    )
    guard = FaultGuard(cfg, rt)  # signal handlers first: a preemption during set-up counts too
    hooks = hooks or Hooks([TrackingHook(cfg.tracking)])
    log: RunLog | None = None
    view: LiveView | None = None
    summary: dict[str, Any] = {}
    status = "failed"
    out_dir: Path | None = None
    try:
        warn = (lambda m: print(f"warning: {m}", file=sys.stderr)) if rt.is_main else None
        out_dir, resume_from = _prepare(cfg, rt, run_dir, config_path, resume, overwrite, warn)

        # --- build: data, model, optimizer --------------------------------------------------
        seed_everything(cfg.train.seed, cfg.train.deterministic)
        precision = setup_precision(cfg.precision, rt.device)
        splits = load_source(cfg.data)
        model_args = complete_args(
            cfg.model.name, cfg.model.args, splits.input_shape, splits.num_classes
        )
        model = build_model(cfg.model.name, model_args).to(rt.device)
        if cfg.train.channels_last:
            model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        n_params = count_parameters(model)
        flops_per_sample = forward_flops_per_sample(
            model, splits.input_shape, splits.input_dtype, device=rt.device
        )
        model = parallelize(model, rt, cfg.parallel, cfg.train, cfg.precision)
        probe = memprobe.SavedActivationProbe(model)  # memprobe
        optimizer = build_optimizer(model.parameters(), cfg.optim, rt.dp_size)
        optimizer = shard_optimizer(optimizer, model, rt, cfg.parallel)
        scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.max_steps)
        scaler = grad_scaler(precision, cfg.parallel, rt)
        pin = rt.device.type == "cuda" and cfg.data.pin_memory
        # Data is split over data-parallel replicas; the ranks of a tensor-parallel group share it.
        train_data = EpochLoader(
            splits.train, cfg.data, rt.dp_rank, rt.dp_size, cfg.train.seed, pin
        )
        val_data = eval_loader(
            shard_for_eval(splits.val, rt.dp_rank, rt.dp_size), cfg.data.batch_size * 2, pin
        )
        torch.manual_seed(cfg.train.seed + rt.rank)  # per-rank randomness (dropout, augmentation)

        # --- resume (and rollback) ---------------------------------------------------------------
        def restore(path: Path) -> int:
            loaded = ckpt.load(path, model, optimizer, rt)
            scheduler.load_state_dict(loaded.trainer["scheduler"])
            scaler.load_state_dict(loaded.trainer["scaler"])
            if loaded.rank_state is not None:
                train_data.load_state_dict(loaded.rank_state["data"])
                ckpt.set_rng_state(loaded.rank_state["rng"])
            else:  # another world size wrote it: continue at the next epoch boundary
                train_data.load_state_dict(
                    {"epoch": int(loaded.trainer.get("epoch", 0)) + 1, "loader": None}
                )
            return loaded.step

        step = restore(resume_from) if resume_from is not None else 0

        # --- run folder, live view --------------------------------------------------------------
        global_batch = cfg.data.batch_size * cfg.train.grad_accum * rt.dp_size
        if rt.is_main:
            out_dir.mkdir(parents=True, exist_ok=True)
            write_text_atomic(out_dir / CONFIG, dump_config(cfg))
            if resume_from is not None:
                truncate_run_log_after(out_dir / "run.jsonl", step)
            log = RunLog(out_dir / "run.jsonl")
            view = LiveView(cfg.train.max_steps, step, quiet)
            if resume_from is not None:
                view.message(f"resumed from {resume_from} at step {step}")
        meter = StepMeter(rt, global_batch, log, view)
        spec = get_spec(cfg.model.name)
        meter.workload = mfu.workload(
            spec.train_flops_per_token_fn(model_args) if spec.train_flops_per_token_fn else None,
            flops_per_sample,
            splits.input_shape,
            splits.input_dtype,
            device_info(rt),
            cfg.precision,
            cfg.train.peak_flops,
            rt.world_size,
        )
        ctx = {"cfg": cfg, "rt": rt, "run_dir": out_dir, "resumed_from": resume_from, "step": step}
        provenance: dict[str, Any] = {}
        if rt.is_main:
            provenance = collect_provenance(
                cfg.model_dump(mode="json"), splits.fingerprint, device_info(rt)
            )
            hooks.start({**ctx, "provenance": provenance})
            meter.extra_sinks.append(hooks.steps)
        guard.attach(model, out_dir, log, view.message if view is not None else None)

        def save_checkpoint(at: int) -> Path:
            with guard.checkpointing():
                return ckpt.save(
                    out_dir / "checkpoints",
                    at,
                    model,
                    optimizer,
                    {
                        "scheduler": scheduler.state_dict(),
                        "scaler": scaler.state_dict(),
                        "epoch": train_data.epoch,
                    },
                    {"rng": ckpt.rng_state(), "data": train_data.state_dict()},
                    rt,
                    cfg.train.keep_last,
                    background=cfg.train.checkpoint_async,
                )

        # --- the loop ---------------------------------------------------------------------------
        accum = cfg.train.grad_accum
        last_eval: dict[str, float] | None = None
        model.train()
        while step < cfg.train.max_steps:
            guard.begin_step(step, drop_batch=train_data.next)
            t0 = time.perf_counter()
            data_wait = 0.0
            optimizer.zero_grad(set_to_none=True)
            loss_sum = torch.zeros((), device=rt.device)
            for micro in range(accum):
                td = time.perf_counter()
                x, y = train_data.next()
                data_wait += time.perf_counter() - td
                x = x.to(rt.device, non_blocking=True)
                y = y.to(rt.device, non_blocking=True)
                if cfg.train.channels_last and x.dim() == 4:
                    x = x.contiguous(memory_format=torch.channels_last)
                with (
                    no_sync(model, skip=micro < accum - 1),
                    precision.autocast(),
                    probe.sample(micro == 0),  # memprobe: one sampled forward per run
                ):
                    loss = cross_entropy(model(x), y) / accum
                scaler.scale(loss).backward()
                loss_sum += loss.detach()
            verdict = guard.check(step, loss_sum, data_wait)
            if verdict.skip:
                continue
            if verdict.rollback_to is not None:
                with guard.checkpointing():
                    step = restore(verdict.rollback_to)
                continue
            if cfg.optim.grad_clip is not None:
                scaler.unscale_(optimizer)
                clip_grad_norm(model, cfg.optim.grad_clip)
            lr = optimizer.param_groups[0]["lr"]
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1
            meter.record(
                step, loss_sum, lr, time.perf_counter() - t0, data_wait, epoch=train_data.epoch
            )

            done = step >= cfg.train.max_steps
            if step % cfg.train.log_every == 0 or done:
                meter.flush()
            if (cfg.train.eval_every and step % cfg.train.eval_every == 0) or done:
                meter.flush()
                last_eval = evaluate(model, val_data, rt, precision, cfg.train.channels_last)
                if rt.is_main:
                    rec = {"kind": "eval", "step": step, **last_eval}
                    if log is not None:
                        log.write(rec)
                    hooks.eval(rec)
            saved = None
            if (cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0) or done:
                path = saved = save_checkpoint(step)
                if rt.is_main:
                    hooks.checkpoint(path, step)
            if verdict.preempt and not done:
                meter.flush()
                guard.stop_for_preemption(step, saved or save_checkpoint(step))
        meter.flush()
        ckpt.wait_pending()
        guard.close()
        if last_eval is None:
            last_eval = evaluate(model, val_data, rt, precision, cfg.train.channels_last)

        # --- memory, export, summary ----------------------------------------------------------
        memory: dict[str, Any] = local_state_bytes(unwrap(model), optimizer)
        memory["peak_allocated_bytes"] = (
            int(torch.cuda.max_memory_allocated(rt.device)) if rt.device.type == "cuda" else None
        )
        memory["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        memory.update(probe.result(rt.device))  # memprobe
        per_rank = all_gather_object(rt, memory)
        weights = full_state_dict(model)  # a collective: every rank gathers its shards
        status = "finished"
        if rt.is_main:
            summary = {
                "status": status,
                "run_dir": str(out_dir),
                "steps": step,
                "world_size": rt.world_size,
                "device": device_info(rt),
                "precision": cfg.precision,
                "global_batch": global_batch,
                "model": {
                    "name": cfg.model.name,
                    "args": model_args,
                    "parameters": n_params,
                    "forward_flops_per_sample": flops_per_sample,
                    "train_flops_per_sample": meter.workload.train_flops_per_sample,
                },
                "data": {
                    "source": cfg.data.source,
                    "fingerprint": splits.fingerprint,
                    "train_samples": len(splits.train),  # type: ignore[arg-type]
                    "val_samples": len(splits.val),  # type: ignore[arg-type]
                    "epochs_seen": train_data.epoch,
                },
                "memory": {**memory, "per_rank": per_rank},
                "throughput": meter.throughput(),
                "final": {**last_eval, "train_loss": meter.last_loss},
                "fault": guard.summary(),
                "resumed_from": str(resume_from) if resume_from else None,
                "environment": {
                    "python": platform.python_version(),
                    "torch": torch.__version__,
                    "hpcml": __version__,
                    "hostname": platform.node(),
                    "platform": platform.platform(),
                },
                "config": cfg.model_dump(mode="json"),
                "provenance": provenance,
            }
            save_export(
                out_dir / "export",
                unwrap(model),
                cfg.model.name,
                model_args,
                splits.input_shape,
                (*splits.target_shape, splits.num_classes),
                input_dtype=splits.input_dtype,
                task=spec.task,
                state=weights,
                metadata={
                    "data": cfg.data.model_dump(mode="json"),
                    "run_dir": str(out_dir),
                    "final": summary["final"],
                    "step": step,
                },
            )
            summary["prediction"] = memprobe.prediction_block(summary)  # memprobe
            hooks.end(summary)
            write_json_atomic(out_dir / "summary.json", summary)
        return summary
    except BaseException as exc:
        if rt.is_main and out_dir is not None and (out_dir / CONFIG).exists():
            kind = "preempted" if isinstance(exc, KeyboardInterrupt | Preempted) else "failed"
            hooks.fail(kind, exc)
            write_json_atomic(
                out_dir / "summary.json",
                {
                    "status": kind,
                    "error": f"{type(exc).__name__}: {exc}"[:500],
                    "run_dir": str(out_dir),
                },
            )
        raise
    finally:
        guard.close()
        if view is not None:
            view.close()
        if log is not None:
            log.close()
        shutdown(rt, clean=status == "finished")
