"""The training loop as a small `Trainer`: `setup`, `train_step`, `evaluate`, `save`, `finish`.

`fit` runs them in order. Fault handling, tracking and anything else that observes or changes a
step enter through named hooks (`hpcml.train.hooks`), not through branches in the loop. Set-up
writes nothing into the run folder until the resolved config has been checked and a resumed
checkpoint has loaded, so a refused start leaves the folder byte-identical.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch

from hpcml import crypt
from hpcml.config import RunConfig, dump_config
from hpcml.data.device_augment import device_augment
from hpcml.data.loader import EpochLoader, eval_loader, shard_for_eval
from hpcml.data.shards.versions import first_read, versions_after_resume
from hpcml.distributed.parallel import (
    grad_norm,
    grad_scaler,
    local_checkpoint_bytes,
    local_value,
    loss_context,
    no_sync,
    shard_optimizer,
    sync_buffers,
)
from hpcml.distributed.precision import setup_precision
from hpcml.distributed.runtime import (
    Runtime,
    broadcast_object,
    init_runtime,
    launched_by_torchrun,
    report_worker_error,
    shutdown,
)
from hpcml.errors import HpcmlError
from hpcml.models.zoo import get_spec
from hpcml.records import CONFIG, RunLog, truncate_run_log_after, write_json_atomic
from hpcml.records import write_text_atomic as write_text
from hpcml.train import finetune, memprobe, mfu, privacy, resume_changes, rundir
from hpcml.train import profile as obs
from hpcml.train.build import SetupMemory, build_training_model
from hpcml.train.checkpoint import store as ckpt
from hpcml.train.checkpoint.manifest import folder_bytes
from hpcml.train.eval_sets import EvalSets
from hpcml.train.evaluation import evaluate_model
from hpcml.train.fault.guard import FaultGuard
from hpcml.train.fault.hook import FaultHook
from hpcml.train.hooks import Hooks, StepDecision
from hpcml.train.losses import resolve_loss
from hpcml.train.metrics import LiveView, StepMeter
from hpcml.train.pipeline import PipelineStep
from hpcml.train.schedule import build_optimizer, build_scheduler, lr_horizon, param_groups
from hpcml.train.summary import build_summary, failure_kind, failure_summary, seed_everything
from hpcml.train.update import optimizer_step
from hpcml.train.validate import resolve


class Trainer:
    def __init__(
        self,
        cfg: RunConfig,
        run_dir: Path | None = None,
        resume: str | None = None,
        overwrite: bool = False,
        quiet: bool = False,
        config_path: Path | None = None,
        hooks: Hooks | None = None,
        allow_fresh_start: bool = False,
    ) -> None:
        self.user_cfg = cfg
        """The config as given (written to config.yaml); `cfg` is a copy with derived values."""
        self.cfg = cfg.model_copy(deep=True)
        self.allow_fresh_start = allow_fresh_start
        self.run_dir_arg, self.resume_arg, self.overwrite = run_dir, resume, overwrite
        self.quiet, self.config_path = quiet, config_path
        if hooks is None:
            from hpcml.train.tracking import TrackingHook

            hooks = Hooks([TrackingHook(cfg.tracking)])
        self.hooks = hooks
        self.step = 0
        self.last_eval: dict[str, float] | None = None
        self.log: RunLog | None = None
        self.view: LiveView | None = None
        self.out_dir: Path | None = None
        self.exporter: Any = None
        self.profiler: Any = None  # torch.profiler over a few steps (`train.profile`)
        self.tracer: Any = None  # OpenTelemetry (`observe.tracing`)
        self.phase: Any = obs.no_phase
        """Prometheus `/metrics` of this rank (`observe.metrics_port`), or None."""
        self.resume_from: Path | None = None
        self.writing = False
        """True once this run has started writing into the run folder."""
        self.fault_hook: FaultHook | None = None
        self.grad_norm: torch.Tensor | None = None
        self.resume_record: dict[str, Any] = {}
        self.resume_state: dict[str, Any] | None = None
        """This step's global gradient norm on the device (None under fp16 loss scaling)."""

    @property
    def seal_key(self) -> crypt.Key | None:
        """The key checkpoints and the export are sealed with (`encryption`), or None."""
        enc = self.cfg.encryption
        return crypt.run_key(enc.enabled, enc.key_file, self.out_dir)

    # --- the whole run ---------------------------------------------------------------------

    def fit(self) -> dict[str, Any]:
        cfg = self.cfg
        p = cfg.parallel
        self.rt = init_runtime(cfg.train.device, p.backend, p.timeout_s, p.tp, p.pp)
        self.hooks.is_main = self.rt.is_main
        self.guard = FaultGuard(cfg, self.rt)  # first: a preemption during set-up counts too
        clean = False
        try:
            finished = self.setup()
            if finished is not None:  # --resume of a finished run: nothing to do, nothing written
                clean = True
                return finished
            while self.step < cfg.train.max_steps:
                with self.phase("hpcml.step", step=self.step + 1, rank=self.rt.rank):
                    with self.step_peak.step(self.step + 1):  # one step's peak, traced (CPU)
                        decision = self.train_step()
                    self.after_step(decision)
            summary = self.finish()
            clean = True
            return summary
        except BaseException as exc:
            self._record_failure(exc)
            if isinstance(exc, HpcmlError) and launched_by_torchrun():
                exc.reported = report_worker_error(exc.message, exc.exit_code)  # type: ignore[attr-defined]
            raise
        finally:
            self.guard.close()
            if self.profiler is not None:
                self.profiler.close()
            obs.flush_tracer(self.tracer)
            if self.exporter is not None:
                self.exporter.close()
            if self.view is not None:
                self.view.close()
            if self.log is not None:
                self.log.close()
            shutdown(self.rt, clean=clean)

    # --- set-up ------------------------------------------------------------------------------

    def setup(self) -> dict[str, Any] | None:
        """Build everything a step needs; returns the summary instead when the run to resume
        has finished already (rank 0's; an empty dict on the others)."""
        cfg, rt = self.cfg, self.rt
        self.setup_memory = SetupMemory()
        # Deterministic checks on every rank before the first collective: all ranks agree.
        self.resolved = resolve(cfg, rt.world_size)
        cfg.train.grad_accum = self.resolved.grad_accum  # derived from train.global_batch
        self.out_dir, self.resume_from = self._prepare_folder()
        done = rundir.finished_summary(self.out_dir, self.resume_from, cfg.train.max_steps)
        finished = broadcast_object(rt, done is not None)  # rank 0 read it for everyone
        seed_everything(cfg.train.seed, cfg.train.deterministic)
        self.precision = setup_precision(cfg.precision, rt.device)
        self.loss_fn = resolve_loss(cfg.train.loss)
        self._build_model()
        self._build_data()
        torch.manual_seed(cfg.train.seed + rt.rank)  # per-rank randomness (dropout)
        if self.resume_from is not None:  # refuses a checkpoint that does not fit, finished or not
            self.guard.watch_checkpoints()  # a read that hangs ends after checkpoint_timeout_s
            self.step = self.restore(self.resume_from, quiet=finished)
        if finished:
            self._warn(rundir.finished_line(self.out_dir, self.resume_from, cfg), prefix="")
            return (done or {}) if rt.is_main else {}
        self.eval_sets.start(self, self.resume_state)  # train.eval_sets: scores before training
        self.setup_rss = self.setup_memory.result()  # this rank's set-up peak and growth
        self._open_run_folder()
        return None

    def _prepare_folder(self) -> tuple[Path, Path | None]:
        """The run folder and the checkpoint to resume from, the same on every rank."""
        return rundir.prepare_shared(
            self.rt,
            self.run_dir_arg or rundir.default_run_dir(self.config_path),
            self.resume_arg,
            self.overwrite,
            self._warn,
            self.allow_fresh_start,
            self.cfg.fault.checkpoint_verify,
        )

    def _warn(self, message: str, prefix: str = "warning: ") -> None:
        if self.rt.is_main:
            print(f"{prefix}{message}", file=sys.stderr, flush=True)

    def _build_model(self) -> None:
        cfg, rt = self.cfg, self.rt
        self.setup_memory.mark_model_start()  # summary's rss_before_model_bytes
        built = build_training_model(cfg, rt, self.resolved)  # on meta, then local shards
        self.model, self.n_params = built.model, built.n_params
        self.flops_per_sample = built.flops_per_sample
        # Saved activations of one sampled forward, measured beside the planner's prediction.
        self.probe = memprobe.SavedActivationProbe(self.model)
        self.device_peaks = memprobe.DevicePeaks(self.rt.device)
        optimizer = build_optimizer(param_groups(self.model, cfg.optim), cfg.optim, rt.dp_size)
        self.optimizer = shard_optimizer(optimizer, self.model, rt, cfg.parallel)
        self.optimizer, self.privacy = privacy.attach(  # privacy.dp_sgd: Opacus's DP optimizer
            self.model, self.optimizer, cfg, cfg.data.batch_size, rt.dp_size,
            len(self.resolved.splits.train),  # type: ignore[arg-type]
        )  # fmt: skip
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, cfg.train.max_steps)
        self.scaler = grad_scaler(self.precision, cfg.parallel, rt)
        self.pipeline = PipelineStep(self) if cfg.parallel.pp > 1 else None
        self.step_peak = memprobe.step_peak(self.model, self.optimizer, cfg, rt.device)

    def _build_data(self) -> None:
        cfg, rt, splits = self.cfg, self.rt, self.resolved.splits
        pin = rt.device.type == "cuda" and cfg.data.pin_memory
        # Data is split over data-parallel replicas; the ranks of a tensor-parallel group share it.
        self.train_data = EpochLoader(
            splits.train, cfg.data, rt.dp_rank, rt.dp_size, cfg.train.seed, pin
        )
        batch = cfg.train.eval_batch_size or cfg.data.batch_size * 2
        self.val_data = eval_loader(shard_for_eval(splits.val, rt.dp_rank, rt.dp_size), batch, pin)
        self.global_batch = cfg.data.batch_size * cfg.train.grad_accum * rt.dp_size
        self.device_augment = device_augment(cfg, rt.dp_rank, splits.num_classes)
        self.device_normalize = splits.device_normalize
        self.data_versions = first_read(splits.version, cfg.data.path)
        self.eval_sets = EvalSets(self.resolved.eval_sets, rt.dp_rank, rt.dp_size, batch, pin)

    def restore(self, path: Path, quiet: bool = False) -> int:
        """Load a checkpoint into model, optimizer, schedule, scaler, data position and RNG;
        changed hyperparameters are applied or refused (`hpcml.train.resume_changes`)."""
        fresh = resume_changes.hyperparameters(self.optimizer)
        t0 = time.perf_counter()
        with self.guard.checkpointing(folder_bytes(path), saving=False):
            optimizer = privacy.state_optimizer(self.optimizer)
            loaded = ckpt.load(path, self.model, optimizer, self.rt, self.cfg, self.seal_key)
        self.guard.load_s = time.perf_counter() - t0
        finetune.check_resume(loaded.trainer, self.cfg, self.resolved, path)  # the same base
        if self.privacy is not None:  # the privacy spent before the checkpoint counts on
            self.privacy.restore(loaded.trainer.get("privacy"))
        self.resume_state = loaded.trainer
        saved_cfg = loaded.trainer.get("config")
        resume_changes.refuse_unappliable(path, saved_cfg, self.cfg)
        self.scheduler.load_state_dict(loaded.trainer["scheduler"])
        # The config's lr, betas, ... over the checkpoint's (the schedule's lambdas are the
        # config's already; an explicit optim.decay_steps may differ from the saved horizon).
        resume_changes.apply_hyperparameters(self.optimizer, self.scheduler, fresh)
        if loaded.trainer["scaler"] or not self.scaler.is_enabled():  # fp16 from another: fresh
            self.scaler.load_state_dict(loaded.trainer["scaler"])
        data = self.cfg.data
        self.data_versions = versions_after_resume(
            loaded.trainer.get("data_versions"),
            self.resolved.splits.version,
            allow_change=data.allow_change,
            checkpoint=path,
            source=data.source,
            path=data.path,
        )
        resume_changes.restore_data(self.train_data, loaded, saved_cfg, self.cfg)
        if loaded.rank_state is not None:
            ckpt.set_rng_state(loaded.rank_state["rng"])
        self.resume_record = resume_changes.record(loaded, saved_cfg, self.cfg)
        note = resume_changes.global_batch_note(
            saved_cfg, loaded.trainer, self.cfg, self.global_batch, self.rt.dp_size
        )
        if note is not None and not quiet:
            self.resume_record["global_batch_note"] = note
            self._warn(note, prefix=f"resuming at step {loaded.step}: ")
        return loaded.step

    def _open_run_folder(self) -> None:
        """From here on the run writes into its folder (and a failure is recorded there)."""
        cfg, rt, res = self.cfg, self.rt, self.resolved
        assert self.out_dir is not None
        if rt.is_main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self.writing = True
            write_text(self.out_dir / CONFIG, dump_config(self.user_cfg))
            # Steps past the resumed one (or every step, starting afresh) are done again.
            truncate_run_log_after(self.out_dir / "run.jsonl", self.step)
            self.log = RunLog(self.out_dir / "run.jsonl")
            self.view = LiveView(cfg.train.max_steps, self.step, self.quiet)
            if self.resume_from is not None:
                self.view.message(f"resumed from {self.resume_from} at step {self.step}")
                self.log.write(self.resume_record)
                if self.resume_record["applied"]:
                    self._warn(resume_changes.applied_line(self.resume_record), prefix="")
        self.meter = StepMeter(rt, self.global_batch, self.log, self.view)
        obs.gpu_preflight(cfg, rt)
        self.exporter = obs.start_exporter(cfg, rt, self.out_dir, self.guard.load_s)
        self.spec = get_spec(cfg.model.name)
        self.meter.workload = mfu.run_workload(cfg, res, rt, self.spec, self.flops_per_sample)
        self.provenance: dict[str, Any] = {}
        if rt.is_main:
            from hpcml.distributed.runtime import device_info
            from hpcml.track.provenance import collect

            self.provenance = collect(
                cfg.model_dump(mode="json"), res.splits.fingerprint, device_info(rt)
            )
            self.meter.extra_sinks.append(self.hooks.steps)
        ctx = {
            "cfg": cfg,
            "rt": rt,
            "run_dir": self.out_dir,
            "resumed_from": self.resume_from,
            "step": self.step,
            "provenance": self.provenance,
        }
        self.hooks.start(ctx)
        self.guard.attach(
            self.model, self.out_dir, self.log, self.view.message if self.view is not None else None
        )
        self.fault_hook = FaultHook(self.guard)
        self.hooks.add(self.fault_hook)
        self.profiler = obs.start_profiler(cfg, rt, self.out_dir)
        self.tracer = obs.start_tracer(cfg, rt, self.out_dir)
        self.phase = obs.make_phase(self.profiler, self.tracer)
        self.model.train()

    # --- one optimizer step ------------------------------------------------------------------

    def train_step(self) -> StepDecision:
        """Forward and backward over `grad_accum` micro-batches, then the optimizer step unless
        a hook decides otherwise."""
        self.hooks.before_step(self)
        t0 = time.perf_counter()
        loss_sum, data_wait = self.forward_backward()
        # The global gradient norm, on the device: every rank decides alike whether this step's
        # gradients are finite (under fp16 loss scaling the scaler decides; see update.py).
        # (Not under DP-SGD either: the norm of the unclipped, noiseless gradients is private.)
        private = self.privacy is not None
        self.grad_norm = None if self.scaler.is_enabled() or private else grad_norm(self.model)
        decision = self.hooks.after_backward(self, loss_sum, data_wait)
        if decision.rollback_to is not None:
            self.step = self.restore(decision.rollback_to)
            return decision
        if decision.skip:
            return decision
        with self.phase("hpcml.optimizer"):
            clip, norm = self.cfg.optim.grad_clip, self.grad_norm  # non-finite: dropped
            lr, skipped = optimizer_step(
                self.model, self.optimizer, self.scheduler, self.scaler, clip, norm
            )
        self.step += 1
        self.meter.record(
            self.step,
            loss_sum,
            lr,
            time.perf_counter() - t0,
            data_wait,
            grad_norm=self.grad_norm,
            skipped=skipped,
            epoch=self.train_data.epoch,
            **memprobe.step_memory(self.rt.device),
            **(self.privacy.step() if self.privacy is not None else {}),  # epsilon spent
        )
        if self.profiler is not None:
            self.profiler.step()
        return decision

    def forward_backward(self) -> tuple[torch.Tensor, float]:
        if self.pipeline is not None:  # parallel.pp: the schedule runs the micro-batches
            return self.pipeline.forward_backward(self)
        accum, dev = self.cfg.train.grad_accum, self.rt.device
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=dev)
        data_wait = 0.0
        for micro in range(accum):
            td = time.perf_counter()
            with self.phase("hpcml.data"):
                x, y = self.train_data.next()
            data_wait += time.perf_counter() - td
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            if self.device_normalize is not None:  # uint8 pixels from the source
                x = self.device_normalize(x)
            if self.device_augment is not None:  # data.augment_on: device
                x, y = self.device_augment.apply(x, y, self.step, micro)
            if self.cfg.train.channels_last and x.dim() == 4:
                x = x.contiguous(memory_format=torch.channels_last)
            with loss_context(self.model):  # loss-parallel TP: loss and backward inside
                with (
                    no_sync(self.model, micro < accum - 1, self.cfg.parallel.accum_reduce),
                    self.precision.autocast(),
                    self.hooks.forward(self),
                    self.probe.sample(micro == 0),  # one sampled forward per run
                    self.phase("hpcml.forward"),
                ):
                    loss = self.loss_fn(self.model(x), y) / accum
                with self.phase("hpcml.backward"):
                    self.scaler.scale(loss).backward()
            loss_sum += local_value(loss.detach())
        return loss_sum, data_wait

    def after_step(self, decision: StepDecision) -> None:
        """Log flush, evaluation, checkpoint, and the stop all ranks agreed on (preemption, Ctrl-C)."""
        t, step = self.cfg.train, self.step
        if decision.skip or decision.rollback_to is not None:
            return
        done = step >= t.max_steps
        evaluating = bool(t.eval_every and step % t.eval_every == 0) or done
        stop_check = self.fault_hook is not None and self.fault_hook.stop_check_due(step)
        if step % t.log_every == 0 or evaluating or stop_check:  # fault.stop_check_s
            decision = decision.merge(self.flush())
        if evaluating:
            self.evaluate()
        saved = None
        if (
            (t.checkpoint_every and step % t.checkpoint_every == 0)
            or self.guard.checkpoint_due(step)  # train.checkpoint_every_s
            or done
        ):
            saved = self.save()
        if (decision.preempt or decision.interrupt) and not done:
            self.flush()
            if decision.preempt:
                self.guard.stop_for_preemption(step, saved or self.save())
            self.guard.stop_for_interrupt(step)

    def flush(self) -> StepDecision | None:
        """Write the buffered step records; the same collective carries the fault hook's
        flags: whether a rank was asked to stop (preempt / interrupt)."""
        hook = self.fault_hook
        records = self.meter.flush(hook.flush_flags() if hook else None)
        if self.exporter is not None:
            self.exporter.update(records, self.guard.counts, self.guard.straggler_series())
        return hook.on_flushed(records, self.meter.flags) if hook else None

    # --- evaluation, checkpoints -------------------------------------------------------------

    def evaluate(self) -> dict[str, float]:
        """Validation loss and accuracy; every rank runs the same number of batches."""
        sync_buffers(self.model)  # rank 0's BatchNorm statistics (DDP broadcasts none per step)
        with self.phase("hpcml.eval", step=self.step), self.device_peaks.evaluating():
            self.last_eval = evaluate_model(
                self.model,
                self.val_data,
                self.rt,
                self.precision,
                self.cfg.train.channels_last,
                self.device_normalize,
                self.pipeline.eval_forward if self.pipeline is not None else None,
            )
            self.last_eval.update(self.eval_sets.evaluate(self))  # train.eval_sets
        if self.exporter is not None:
            self.exporter.evaluated(self.last_eval)
        if self.rt.is_main:
            rec = {"kind": "eval", "step": self.step, **self.last_eval}
            if self.log is not None:
                self.log.write(rec)
            self.hooks.eval(rec)
        return self.last_eval

    def save(self) -> Path:
        assert self.out_dir is not None
        cfg = self.cfg
        trainer_state = {
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "epoch": self.train_data.epoch,
            "data_position": self.train_data.position(),
            "data_versions": self.data_versions,
            "lr_horizon": lr_horizon(cfg.optim, cfg.train.max_steps),
            "config": cfg.model_dump(mode="json"),
            **finetune.checkpoint_fields(cfg, self.resolved),  # the base's sha256
            **self.eval_sets.checkpoint_fields(),  # the scores before training
            **({"privacy": self.privacy.state()} if self.privacy is not None else {}),
        }
        sync_buffers(self.model)
        nbytes, t0 = local_checkpoint_bytes(self.model, self.optimizer), time.perf_counter()
        with self.guard.checkpointing(nbytes), self.phase("hpcml.checkpoint", step=self.step):
            path = ckpt.save(
                self.out_dir / "checkpoints",
                self.step,
                self.model,
                privacy.state_optimizer(self.optimizer),
                trainer_state,
                {"rng": ckpt.rng_state(), "data": self.train_data.state_dict()},
                self.rt,
                cfg.train.keep_last,
                background=cfg.train.checkpoint_async,
                writer_nice=cfg.train.checkpoint_writer_nice,
                verify=cfg.fault.checkpoint_verify,
                key=self.seal_key,
            )
        if self.rt.is_main:
            self.hooks.checkpoint(path, self.step)
        if self.exporter is not None:
            self.exporter.checkpointed(time.perf_counter() - t0)
        return path

    # --- the end -----------------------------------------------------------------------------

    def finish(self) -> dict[str, Any]:
        """Wait for checkpoints, evaluate if not yet done, export and write summary.json."""
        self.flush()
        ckpt.wait_pending()
        self.guard.close()
        if self.last_eval is None:
            self.evaluate()
        summary = build_summary(self)  # collectives inside: every rank calls it
        if self.rt.is_main:
            if self.profiler is not None and self.profiler.breakdown is not None:
                summary["profile"] = self.profiler.summary()
            summary["prediction"] = memprobe.prediction_block(summary)
            self.hooks.end(summary)
            assert self.out_dir is not None
            write_json_atomic(self.out_dir / "summary.json", summary)
        return summary

    def _record_failure(self, exc: BaseException) -> None:
        """A run that had started writing records how it ended; a refused start writes nothing."""
        if not (self.rt.is_main and self.writing and self.out_dir is not None):
            return
        kind = failure_kind(exc)
        self.hooks.fail(kind, exc)
        record = failure_summary(kind, exc, self.out_dir, getattr(self, "provenance", None))
        write_json_atomic(self.out_dir / "summary.json", record)


def run(
    cfg: RunConfig,
    run_dir: Path | None = None,
    resume: str | None = None,
    overwrite: bool = False,
    quiet: bool = False,
    config_path: Path | None = None,
    hooks: Hooks | None = None,
    allow_fresh_start: bool = False,
) -> dict[str, Any]:
    """Train `cfg` to its end; the summary on rank 0, an empty dict on the other ranks."""
    trainer = Trainer(cfg, run_dir, resume, overwrite, quiet, config_path, hooks, allow_fresh_start)
    return trainer.fit()


_ = Runtime  # re-exported for type hints of hooks
