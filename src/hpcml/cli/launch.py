"""Launch training on a cluster: `hpcml launch slurm ...`, and checkpoint-interval advice
(`hpcml launch checkpoint-interval RUN_DIR --mtbf 24h`)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import typer

app = typer.Typer(help=__doc__, no_args_is_help=True)

_DURATION_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(s|m|min|h|d)?\s*$")
_UNIT_S = {None: 1.0, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration_s(text: str, option: str) -> float:
    from hpcml.errors import ConfigError

    m = _DURATION_RE.match(text)
    if not m or float(m.group(1)) <= 0:
        raise ConfigError(
            f"{option} {text!r} is not a positive duration; write e.g. 3600, 90m, 24h or 7d."
        )
    return float(m.group(1)) * _UNIT_S[m.group(2)]


def _check_tune(config: Path, overrides: list[str], workers: int, nodes: int) -> None:
    """The config's tune section and space, checked before anything is queued."""
    from hpcml.errors import LaunchError

    if workers < 0:
        raise LaunchError(f"--tune-workers {workers} cannot be negative.")
    if nodes != 1:
        raise LaunchError(
            f"--nodes {nodes} with --tune-workers: each tune worker runs on one node (its "
            "trials on --nproc-per-node processes); give --nodes 1 and more --tune-workers."
        )
    try:
        from hpcml.tune.study import prepare
    except ImportError:
        raise LaunchError(
            "--tune-workers needs Optuna, which is not installed; pip install 'hpcml[tune]'."
        ) from None
    prepare(config, tuple(overrides))


def _tune_result(job: Any, path: Path, workers: int, job_id: str | None, json_out: bool) -> None:
    from hpcml.cli.common import console, print_json

    result = {
        "script": str(path),
        "study_dir": str(job.run_dir.resolve()),
        "log": str(job.run_dir.resolve() / "slurm-%A_%a.out"),
        "tune_workers": workers,
        "nproc": job.workers_per_node,
        "time": job.time,
        "job_id": job_id,
    }
    if json_out:
        print_json(result)
        return
    for key, value in result.items():
        console.print(f"{key}: {value}")
    if job_id is None:
        console.print(f"submit with: sbatch {path}")


def _fmt_s(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.2f} h"


@app.command("slurm")
def slurm(
    config: Path = typer.Argument(..., help="YAML config of the run."),
    overrides: list[str] = typer.Argument(None, help="Dotted overrides, e.g. optim.lr=0.01."),
    nodes: int = typer.Option(..., "--nodes", help="Nodes to allocate."),
    gpus_per_node: int = typer.Option(
        0, "--gpus-per-node", help="GPUs per node (one worker each); 0 for CPU nodes."
    ),
    time_limit: str = typer.Option(..., "--time", help="Time limit per attempt, HH:MM:SS."),
    partition: str | None = typer.Option(None, "--partition", help="SLURM partition."),
    account: str | None = typer.Option(None, "--account", help="SLURM account to charge."),
    nproc_per_node: int | None = typer.Option(
        None, "--nproc-per-node", help="Workers per node (default: one per GPU, 1 on CPU)."
    ),
    cpus_per_task: int | None = typer.Option(
        None,
        "--cpus-per-task",
        help="CPU cores per node for its workers (default: the node's cores / its GPUs x "
        "--gpus-per-node, from sinfo; a CPU job gets the whole node).",
    ),
    mem: str | None = typer.Option(
        None, "--mem", help="Memory per node, e.g. 480G (default: from sinfo)."
    ),
    mem_per_gpu: str | None = typer.Option(
        None, "--mem-per-gpu", help="Memory per GPU, e.g. 60G (default on GPU nodes: from sinfo)."
    ),
    numa_binding: str = typer.Option(
        "node",
        "--numa-binding",
        help="Bind each worker to the cores next to its GPU (torchrun --numa-binding): node, "
        "socket, exclusive, core-complex or none.",
    ),
    max_requeues: int = typer.Option(
        3, "--max-requeues", help="Requeues (preemptions, node failures) before the job stops."
    ),
    mtbf: str | None = typer.Option(
        None,
        "--mtbf",
        help="Mean time between failures of the job, e.g. 24h: with train.checkpoint_every 0, "
        "checkpoint every Daly interval (train.checkpoint_every_s).",
    ),
    checkpoint_s: float | None = typer.Option(
        None,
        "--checkpoint-s",
        help="Checkpoint cost in seconds for --mtbf (default: measured in RUN_DIR).",
    ),
    run_dir: Path | None = typer.Option(
        None, "--run-dir", help="Run folder on a shared filesystem (default runs/<config>-<time>)."
    ),
    signal_lead_s: int = typer.Option(
        90, "--signal-lead", help="Seconds before the time limit at which SLURM sends USR1."
    ),
    max_restarts: int = typer.Option(
        2, "--max-restarts", help="Elastic restarts after a worker failure, per attempt."
    ),
    job_name: str | None = typer.Option(None, "--job-name"),
    port: int | None = typer.Option(
        None, "--port", help="Rendezvous port on the first node (default 20000 + job id % 20000)."
    ),
    sbatch_extra: list[str] = typer.Option(
        None, "--sbatch", help="Another #SBATCH option, e.g. --sbatch=--qos=high (repeatable)."
    ),
    script: Path | None = typer.Option(
        None, "--script", help="Where to write the sbatch script (default RUN_DIR/job.sbatch)."
    ),
    exclusive: bool | None = typer.Option(
        None,
        "--exclusive/--shared",
        help="Whole nodes, and cores next to the GPUs (--gres-flags=enforce-binding); default: "
        "--exclusive for multi-node GPU jobs.",
    ),
    submit: bool = typer.Option(False, "--submit", help="Submit it with sbatch."),
    tune_workers: int = typer.Option(
        0,
        "--tune-workers",
        help="Instead of one training run: a job array of N `hpcml tune` workers on the study "
        "in RUN_DIR (the config's tune section), each on one node, its trials on "
        "--nproc-per-node processes.",
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Write an sbatch script for `hpcml train` under torchrun (preemption-safe), or for tune
    workers (`--tune-workers`), and submit it."""
    from hpcml.cli.common import console, print_json
    from hpcml.config import load_config
    from hpcml.launch.slurm import SlurmJob, node_shape, write_script
    from hpcml.launch.slurm import submit as sbatch_submit
    from hpcml.models.zoo import get_spec
    from hpcml.train import rundir

    cfg = load_config(config, overrides or [])  # bad configs fail here, not in the queue
    get_spec(cfg.model.name)
    if tune_workers:
        _check_tune(config, overrides or [], tune_workers, nodes)
        run_dir = run_dir or Path("runs") / f"tune-{config.stem}"
    chosen = run_dir or rundir.default_run_dir(config)
    interval = None if tune_workers else _checkpoint_interval(cfg, chosen, mtbf, checkpoint_s)
    if not tune_workers:
        _check_signal_lead(cfg, chosen, signal_lead_s, checkpoint_s)
    if interval is not None:
        overrides = [
            *(overrides or []),
            f"train.checkpoint_every_s={interval['daly_interval_s']:.0f}",
        ]
    job = SlurmJob(
        config=config,
        run_dir=chosen,
        nodes=nodes,
        time=time_limit,
        gpus_per_node=gpus_per_node,
        nproc_per_node=nproc_per_node,
        partition=partition,
        account=account,
        cpus_per_task=cpus_per_task,
        mem=mem,
        mem_per_gpu=mem_per_gpu,
        numa_binding=numa_binding,
        max_requeues=max_requeues,
        overrides=list(overrides or []),
        job_name=job_name,
        signal_lead_s=signal_lead_s,
        max_restarts=max_restarts,
        rdzv_port=port,
        sbatch_extra=list(sbatch_extra or []),
        exclusive=exclusive,
    )
    if cpus_per_task is None or not (mem or mem_per_gpu):
        job.fill_from(node_shape(partition, gpus_per_node))
    if tune_workers:
        from hpcml.launch.slurm import render_tune_sbatch

        path = write_script(job, script, render_tune_sbatch(job, tune_workers, []))
        _tune_result(job, path, tune_workers, sbatch_submit(path) if submit else None, json_out)
        return
    path = write_script(job, script)
    job_id = sbatch_submit(path) if submit else None
    result: dict[str, Any] = {
        "script": str(path),
        "run_dir": str(chosen.resolve()),
        "log": str(job.log_path.resolve()),
        "nodes": nodes,
        "workers_per_node": job.workers_per_node,
        "world_size": nodes * job.workers_per_node,
        "time": time_limit,
        "signal": f"USR1@{signal_lead_s}",
        "cpus_per_task": job.cpus_per_task,
        "mem": job.mem,
        "mem_per_gpu": job.mem_per_gpu,
        "max_requeues": max_requeues,
        "checkpoint_every_s": interval["daly_interval_s"] if interval else None,
        "checkpoint_s": interval["checkpoint_s"] if interval else None,
        "restart_s": interval["restart_s"] if interval else None,
        "resumes_existing_run": rundir.holds_run(chosen),
        "job_id": job_id,
    }
    if json_out:
        print_json(result)
        return
    from rich.table import Table

    table = Table(title="SLURM job", show_header=False)
    table.add_column("what")
    table.add_column("value")
    for key in (
        "script",
        "run_dir",
        "log",
        "world_size",
        "cpus_per_task",
        "mem",
        "mem_per_gpu",
        "time",
        "signal",
        "max_requeues",
        "job_id",
    ):
        if result[key] is None and key.startswith("mem"):
            continue
        table.add_row(key, str(result[key]))
    console.print(table)
    if result["resumes_existing_run"]:
        console.print(f"note: {chosen} already holds a run; the job continues it (--resume auto).")
    if interval is not None:
        console.print(
            f"train.checkpoint_every was 0: checkpointing every {_fmt_s(interval['daly_interval_s'])}"
            f" (Daly, checkpoint cost until durable {_fmt_s(interval['checkpoint_s'])} "
            f"{interval['checkpoint_s_source']}, restart {_fmt_s(interval['restart_s'])} "
            f"{interval['restart_s_source']}, MTBF {_fmt_s(interval['mtbf_s'])})."
        )
    if job_id is None:
        console.print(f"submit with: sbatch {path}")


def _checkpoint_interval(
    cfg: Any, run_dir: Path, mtbf: str | None, checkpoint_s: float | None
) -> dict[str, Any] | None:
    """A requeued job resumes from its newest checkpoint: refuse a config that saves only at
    the end, or (with --mtbf) give it Daly's interval from the measured or given cost."""
    from hpcml.errors import ConfigError
    from hpcml.train.fault.guard import checkpoint_advice

    if cfg.train.checkpoint_every or cfg.train.checkpoint_every_s:
        return None
    if mtbf is None:
        raise ConfigError(
            "train.checkpoint_every is 0 and train.checkpoint_every_s is null, so a preempted or "
            "failed attempt would start again from step 0; set one of them, or pass --mtbf "
            "(e.g. --mtbf 24h) to checkpoint every Daly interval."
        )
    source = "given (--checkpoint-s)"
    measured = _measured_checkpoints(run_dir)
    if checkpoint_s is None and measured:
        checkpoint_s = durable_s(measured)
        source = f"measured in {run_dir}"
    if not checkpoint_s:
        raise ConfigError(
            "--mtbf needs the checkpoint cost: pass --checkpoint-s (seconds one checkpoint "
            "stalls training), or a --run-dir whose summary.json measured it."
        )
    restart_s, restart_source = RESTART_S, "assumed (no resume measured a load)"
    if measured.get("load_s") is not None:
        restart_s, restart_source = float(measured["load_s"]), f"load measured in {run_dir}"
    advice = checkpoint_advice(checkpoint_s, parse_duration_s(mtbf, "--mtbf"), restart_s)
    advice["checkpoint_s_source"] = source
    advice["restart_s_source"] = restart_source
    return advice


def _measured_checkpoints(run_dir: Path) -> dict[str, Any]:
    """What a run in `run_dir` measured of its checkpoints (summary.json), or {}."""
    from hpcml.records import read_summary

    if not (run_dir / "summary.json").exists():
        return {}
    return ((read_summary(run_dir).get("fault") or {}).get("checkpoints")) or {}


def _check_signal_lead(
    cfg: Any, run_dir: Path, signal_lead_s: int, checkpoint_s: float | None
) -> None:
    """After SLURM's USR1 the ranks agree on the stop within fault.stop_check_s, then save: a
    lead shorter than both together ends the job before its checkpoint is durable."""
    from hpcml.errors import ConfigError

    stop_s = cfg.fault.stop_check_s
    if stop_s is None or cfg.fault.preempt_check_every is not None:
        return  # a bound in steps, not seconds
    source = "given (--checkpoint-s)"
    if checkpoint_s is None:
        checkpoint_s, source = durable_s(_measured_checkpoints(run_dir)), f"measured in {run_dir}"
    need = stop_s + (checkpoint_s or 0.0)
    if signal_lead_s < need:
        save = f" + the save, {checkpoint_s:.0f} s {source}" if checkpoint_s else ""
        raise ConfigError(
            f"--signal-lead {signal_lead_s} s is shorter than the time a preempted run needs to "
            f"stop and save ({need:.0f} s: fault.stop_check_s {stop_s:g} s{save}); pass a longer "
            "--signal-lead or a smaller fault.stop_check_s."
        )


RESTART_S = 60.0
"""Restart cost (requeue and load) assumed where no resume of the run measured its load."""


def durable_s(measured: dict[str, Any]) -> float | None:
    """Daly's checkpoint cost: the time until a save is durable (an async save's background
    write included), where the run measured it, else the time it stalled training."""
    return measured.get("total_s_median") or measured.get("stall_s_median")


@app.command("checkpoint-interval")
def checkpoint_interval(
    run_dir: Path | None = typer.Argument(
        None, help="A finished run: its measured checkpoint time and step time are used."
    ),
    mtbf: str | None = typer.Option(
        None, "--mtbf", help="Mean time between failures of the whole job, e.g. 24h."
    ),
    node_mtbf: str | None = typer.Option(
        None, "--node-mtbf", help="Mean time between failures of one node (with --nodes)."
    ),
    nodes: int = typer.Option(1, "--nodes", help="Nodes of the job (with --node-mtbf)."),
    checkpoint_s: float | None = typer.Option(
        None, "--checkpoint-s", help="Checkpoint cost in seconds (default: measured in RUN_DIR)."
    ),
    restart_s: float | None = typer.Option(
        None,
        "--restart-s",
        help="Time from a failure to training again (default: the checkpoint load measured in "
        "RUN_DIR by a resume, else 60 s).",
    ),
    step_time_s: float | None = typer.Option(
        None, "--step-time-s", help="Seconds per step (default: measured in RUN_DIR)."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the advice as JSON."),
) -> None:
    """Young/Daly optimal checkpoint interval and the expected lost work per failure."""
    from hpcml.cli.common import console, print_json
    from hpcml.errors import ConfigError
    from hpcml.records import read_summary
    from hpcml.train.fault.guard import checkpoint_advice

    if (mtbf is None) == (node_mtbf is None):
        raise ConfigError("give exactly one of --mtbf (whole job) or --node-mtbf with --nodes.")
    if nodes < 1:
        raise ConfigError(f"--nodes {nodes} must be at least 1.")
    job_mtbf = (
        parse_duration_s(mtbf, "--mtbf")
        if mtbf is not None
        else parse_duration_s(node_mtbf or "", "--node-mtbf") / nodes
    )
    source, restart_source = "given", "given (--restart-s)"
    if run_dir is not None and (checkpoint_s is None or step_time_s is None or restart_s is None):
        if not (run_dir / "summary.json").exists():
            raise ConfigError(
                f"{run_dir} has no summary.json; pass a finished run folder or --checkpoint-s."
            )
        summary = read_summary(run_dir)
        measured = (summary.get("fault") or {}).get("checkpoints") or {}
        if checkpoint_s is None:
            checkpoint_s = durable_s(measured)
            source = f"measured in {run_dir} ({measured.get('count', 0)} checkpoints)"
        if restart_s is None and measured.get("load_s") is not None:
            restart_s, restart_source = float(measured["load_s"]), f"load measured in {run_dir}"
        if step_time_s is None:
            step_time_s = (summary.get("throughput") or {}).get("step_time_s")
    if not checkpoint_s:
        raise ConfigError(
            "no checkpoint time: pass --checkpoint-s, or a run folder whose summary.json has "
            "fault.checkpoints (a run that saved at least one checkpoint)."
        )
    if restart_s is None:
        restart_s, restart_source = RESTART_S, "assumed (no resume measured a load)"
    advice = checkpoint_advice(checkpoint_s, job_mtbf, restart_s, step_time_s)
    advice["checkpoint_s_source"] = source
    advice["restart_s_source"] = restart_source
    if json_out:
        print_json(advice)
        return
    from rich.table import Table

    table = Table(title="checkpoint interval (Young 1974 / Daly 2006)", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("checkpoint cost (until durable)", _fmt_s(checkpoint_s))
    table.add_row("  from", source)
    table.add_row("mean time between failures (job)", _fmt_s(job_mtbf))
    table.add_row("restart time", _fmt_s(restart_s))
    table.add_row("  from", restart_source)
    table.add_row("Young interval sqrt(2CM)", _fmt_s(advice["young_interval_s"]))
    table.add_row("Daly interval (used)", _fmt_s(advice["daly_interval_s"]))
    if advice["checkpoint_every_steps"] is not None:
        table.add_row(
            "train.checkpoint_every",
            f"{advice['checkpoint_every_steps']} steps (at {step_time_s:.3g} s/step)",
        )
    table.add_row(
        "expected lost work per failure", _fmt_s(advice["expected_lost_work_per_failure_s"])
    )
    table.add_row("expected overhead", f"{advice['expected_overhead_fraction'] * 100:.2f} %")
    console.print(table)
