"""Train a model from a YAML config on 1..N processes: `hpcml train CONFIG [key=value ...]`."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import typer


def train(
    config: Path = typer.Argument(..., help="YAML config, e.g. examples/digits_cnn.yaml."),
    overrides: list[str] = typer.Argument(
        None, help="Dotted overrides, e.g. optim.lr=0.01 train.max_steps=200."
    ),
    nproc: int = typer.Option(
        1, "--nproc", help="Processes on this machine; >1 starts torchrun's elastic agent (DDP)."
    ),
    run_dir: Path | None = typer.Option(
        None, "--run-dir", help="Output folder (default runs/<config>-<time>)."
    ),
    resume: str | None = typer.Option(
        None,
        "--resume",
        help="'auto' (newest complete checkpoint in the run folder) or a checkpoint path.",
    ),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Replace a run folder that already holds a finished run."
    ),
    quiet: bool = typer.Option(False, "--quiet", help="Log lines instead of a live progress bar."),
    max_restarts: int = typer.Option(
        0,
        "--max-restarts",
        help="Elastic restarts of the whole group after a worker failure (--nproc > 1).",
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the summary as JSON at the end."),
    allow_fresh_start: bool = typer.Option(  # [fault] issue 11
        False,
        "--allow-fresh-start",
        help="With --resume auto: when checkpoints exist but none is complete, move them to "
        "checkpoints/corrupt/ and start from step 0 (without it, the run refuses).",
    ),
    allow_data_change: bool = typer.Option(
        False,
        "--allow-data-change",
        help="Resume onto a shard set of another version than the checkpoint's, recording "
        "every version read (data.allow_change); without it such a resume is refused.",
    ),
    strict_health: bool = typer.Option(
        False,
        "--strict-health",
        help="Refuse to start on a GPU whose NVML health pre-flight finds a problem "
        "(observe.strict_health).",
    ),
) -> None:
    """Train a model from a YAML config on one process or several (DDP)."""
    from hpcml.config import load_config
    from hpcml.distributed.runtime import (
        launched_by_torchrun,
        peer_failed_first,
        report_worker_error,
    )
    from hpcml.errors import HpcmlError
    from hpcml.launch.local import check_nproc
    from hpcml.track.mlflow import check_resume_store
    from hpcml.train.entry import check_encryption, preflight, run_here
    from hpcml.train.fault.guard import require_checkpoints_for_restarts

    if strict_health:
        overrides = [*(overrides or []), "observe.strict_health=true"]
    if allow_data_change:
        overrides = [*(overrides or []), "data.allow_change=true"]
    cfg = load_config(config, overrides or [])
    if launched_by_torchrun():
        # A worker: torchrun (ours or the user's) chose the world; rank 0 checks the folder.
        try:
            check_resume_store(cfg.tracking, run_dir, resume)
            summary = run_here(cfg, config, run_dir, resume, overwrite, quiet, allow_fresh_start)
        except HpcmlError as exc:
            if not getattr(exc, "reported", False):
                report_worker_error(exc.message, exc.exit_code)
            raise SystemExit(exc.exit_code) from None
        except Exception:
            if peer_failed_first():  # a collective broke because a peer stopped on its error
                raise SystemExit(1) from None
            raise
    else:
        check_nproc(nproc)
        # With several processes, the whole resolved config is checked here, before torchrun.
        preflight(cfg, nproc if nproc > 1 else None)
        check_encryption(cfg, run_dir, resume)
        check_resume_store(cfg.tracking, run_dir, resume)
        if nproc == 1:
            summary = run_here(cfg, config, run_dir, resume, overwrite, quiet, allow_fresh_start)
        else:
            require_checkpoints_for_restarts(cfg, max_restarts)
            launch_workers(
                config,
                overrides or [],
                nproc,
                run_dir,
                resume,
                overwrite,
                quiet,
                max_restarts,
                json_out,
                allow_fresh_start,
            )
            return
    if summary:
        report(summary, json_out)


def launch_workers(
    config: Path,
    overrides: list[str],
    nproc: int,
    run_dir: Path | None,
    resume: str | None,
    overwrite: bool,
    quiet: bool,
    max_restarts: int,
    json_out: bool,
    allow_fresh_start: bool,
) -> None:
    """Run `nproc` workers under torchrun's agent; a worker's HpcmlError ends here as its one
    sentence and exit code (rank 0 has printed it already; another rank's is printed here).
    Exit 75 only with the checkpoint saved for this preemption; 130 for Ctrl-C
    (see hpcml.train.fault.guard.worker_outcome)."""
    import tempfile

    from hpcml.errors import REQUEUE_EXIT_CODE, HpcmlError, Interrupted, Preempted, WorkFailed
    from hpcml.launch.local import run_torchrun, worker_error
    from hpcml.train.entry import prepare_for_workers
    from hpcml.train.fault.guard import worker_outcome

    chosen = prepare_for_workers(config, run_dir, resume, overwrite, allow_fresh_start)
    args = ["train", str(config), *overrides, "--run-dir", str(chosen)]
    if resume is not None:
        args += ["--resume", resume]
    elif max_restarts > 0:
        args += ["--resume", "auto"]  # the folder was checked empty; restarts resume
    args += ["--quiet"] * quiet + ["--json"] * json_out
    args += ["--allow-fresh-start"] * allow_fresh_start
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="hpcml-workers-") as errors:
        rc = run_torchrun(nproc, args, max_restarts, errors_dir=Path(errors))
        failure = worker_error(Path(errors)) if rc != 0 else None
    if failure is not None and failure.sentence is not None:
        if failure.rank == 0:
            raise SystemExit(failure.exit_code)  # rank 0 printed its sentence already
        exc = HpcmlError(failure.sentence)
        exc.exit_code = failure.exit_code
        raise exc
    status, saved = worker_outcome(chosen, started)
    if rc != 0 and status == "preempted" and saved is not None:
        raise Preempted(
            f"training with {nproc} processes was preempted and saved checkpoint {saved}; "
            f"continue with --resume auto (exit code {REQUEUE_EXIT_CODE} asks a scheduler "
            "to requeue).",
            checkpoint=str(saved),
        )
    if rc != 0 and (status == "interrupted" or rc == 130):
        raise Interrupted(
            f"training with {nproc} processes was interrupted (SIGINT); no checkpoint was "
            f"saved for it. Continue from the newest complete one in {chosen} with "
            "--resume auto."
        )
    if rc != 0:
        what = f"rank {failure.rank} {failure.how}" if failure else f"exit code {rc}"
        where = f" and {chosen}" if chosen.exists() else ""
        raise WorkFailed(
            f"training with {nproc} processes failed ({what}); see the worker output above{where}."
        )


def report(summary: dict[str, Any], json_out: bool) -> None:
    from rich.table import Table

    from hpcml.cli.common import console, print_json

    if json_out:
        print_json(summary)
        return
    final, thr = summary["final"], summary["throughput"]
    table = Table(title=f"run {summary['run_dir']}", show_header=False)
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("steps", str(summary["steps"]))
    table.add_row("processes x device", f"{summary['world_size']} x {summary['device']['type']}")
    table.add_row("precision", summary["precision"])
    table.add_row("val_accuracy", f"{final['val_accuracy']:.4f}")
    table.add_row("val_loss", f"{final['val_loss']:.4f}")
    if final.get("train_loss") is not None:
        table.add_row("train_loss (last step)", f"{final['train_loss']:.4f}")
    if thr.get("samples_per_s"):
        table.add_row("samples/s (median step)", f"{thr['samples_per_s']:,.0f}")
        table.add_row("step time (median)", f"{thr['step_time_s'] * 1000:.1f} ms")
    if thr.get("tokens_per_s"):
        table.add_row("tokens/s per device", f"{thr['tokens_per_s_per_device']:,.0f}")
    if thr.get("mfu") is not None:
        table.add_row("MFU", f"{thr['mfu']:.1%}")
    table.add_row("export", f"{summary['run_dir']}/export/model.safetensors")
    prof = summary.get("profile")
    if prof and prof.get("steps"):
        table.add_row(
            f"profiled step ({prof['steps']} steps, median)",
            f"{prof['step_s'] * 1000:.1f} ms: data {prof['data_share']:.0%}, compute "
            f"{prof['compute_share']:.0%}, other {prof['other_share']:.0%}; a collective in "
            f"flight {prof['communication_in_flight_share']:.0%}",
        )
        dev = prof.get("device")
        if dev and dev.get("steps"):
            table.add_row(
                "device timeline (median step)",
                f"compute {dev['compute_share']:.0%}, communication "
                f"{dev['communication_share']:.0%} (in flight "
                f"{dev['communication_in_flight_share']:.0%}), memcpy "
                f"{dev['memcpy_share']:.0%}, idle {dev['idle_share']:.0%}: data "
                f"{dev['data_share']:.0%}, host overhead {dev['host_overhead_share']:.0%}",
            )
        for op in prof.get("top_ops") or []:  # the costliest, by device then self CPU time
            cost = op["device_s"] or op["self_cpu_s"]
            where = "device" if op["device_s"] else "self CPU"
            table.add_row(f"  op {op['op'][:48]}", f"{cost * 1000:.2f} ms {where}, {op['calls']} calls")
        table.add_row("profile (trace, breakdown, top ops)", f"{summary['run_dir']}/profile/")
    console.print(table)
