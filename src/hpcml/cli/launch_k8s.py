"""`hpcml launch k8s` (a training job as a JobSet or TrainJob) and `hpcml launch k8s-serve`
(a Deployment + Service + HPA, or a KServe InferenceService): manifests written to a folder,
checked before anything is written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from hpcml.errors import ConfigError, LaunchError

MAX_NODES = 10_000
MAX_GPUS_PER_NODE = 64


def check_layout(cfg: Any, world: int, where: str) -> None:
    """The arithmetic a worker would refuse at start-up, refused here instead: tensor
    parallelism and the global batch must divide over the job's processes."""
    from hpcml.train.validate import derive_grad_accum

    tp = cfg.parallel.tp
    if world % tp:
        raise ConfigError(
            f"parallel.tp {tp} does not divide the {world} processes of {where}; choose "
            f"--nodes and --gpus-per-node whose product is a multiple of {tp}, or lower "
            "parallel.tp."
        )
    derive_grad_accum(cfg, world // tp)


def check_fit(cfg: Any, world: int, gpu: str, catalog: list[Path]) -> Any:
    """The planner's memory verdict on `world` devices named `gpu`; refused when over."""
    from hpcml.plan.fit import memory_fit
    from hpcml.plan.hardware import load_catalog

    fit = memory_fit(cfg.model_dump(mode="json"), cfg.precision, world, gpu, load_catalog(catalog))
    if not fit.fits:
        raise LaunchError(
            f"the config does not fit {world} x {fit.device}: {fit.reason()}; use more GPUs, "
            "a sharded parallel.strategy (zero3), a smaller data.batch_size or "
            "activation checkpointing."
        )
    return fit


def _grace(
    cfg: Any,
    overrides: list[str],
    grace_s: int | None,
    checkpoint_s: float | None,
    measured_run: Path | None,
    mtbf: str | None,
) -> tuple[list[str], int, str]:
    """Overrides (a Daly interval with --mtbf), the grace period and where its save time came
    from: given, measured in a run folder, or assumed."""
    from hpcml.cli.launch import _checkpoint_interval, _measured_checkpoints, durable_s
    from hpcml.launch.k8s import DEFAULT_CHECKPOINT_S, grace_seconds

    if mtbf is not None and checkpoint_s is None and measured_run is None:
        raise ConfigError(
            "--mtbf needs the checkpoint cost: pass --checkpoint-s (seconds one checkpoint "
            "takes) or --measured-run (a run folder whose summary.json measured it)."
        )
    interval = _checkpoint_interval(cfg, measured_run or Path("."), mtbf, checkpoint_s)
    if interval is not None:
        overrides = [*overrides, f"train.checkpoint_every_s={interval['daly_interval_s']:.0f}"]
    source = "given (--checkpoint-s)"
    if checkpoint_s is None and measured_run is not None:
        checkpoint_s = durable_s(_measured_checkpoints(measured_run))
        if checkpoint_s is None:
            raise ConfigError(
                f"--measured-run {measured_run} holds no measured checkpoint (summary.json "
                "fault.checkpoints); pass a run that saved one, or --checkpoint-s."
            )
        source = f"measured in {measured_run}"
    if checkpoint_s is None:
        checkpoint_s, source = DEFAULT_CHECKPOINT_S, "assumed (no --checkpoint-s or --measured-run)"
    if grace_s is not None:
        return overrides, grace_s, "given (--grace-s)"
    grace = grace_seconds(cfg.fault.stop_check_s or 5.0, checkpoint_s)
    return overrides, grace, f"save {checkpoint_s:.0f} s {source}"


def k8s(
    config: Path = typer.Argument(..., help="YAML config of the run."),
    overrides: list[str] = typer.Argument(None, help="Dotted overrides, e.g. optim.lr=0.01."),
    nodes: int = typer.Option(..., "--nodes", help="Pods (one per node)."),
    gpus_per_node: int = typer.Option(
        ..., "--gpus-per-node", help="nvidia.com/gpu per pod, one worker each; 0 for CPU pods."
    ),
    out: Path = typer.Option(..., "--out", help="Folder to write the manifests to."),
    image: str = typer.Option(
        "hpcml:latest", "--image", help="Container image with hpcml (the repository's Dockerfile)."
    ),
    kind: str = typer.Option("jobset", "--kind", help="jobset or trainjob (Kubeflow Trainer v2)."),
    queue: str | None = typer.Option(
        None, "--queue", help="Kueue LocalQueue: gang admission and quotas."
    ),
    name: str | None = typer.Option(None, "--name", help="Job name (default: the config's)."),
    namespace: str | None = typer.Option(None, "--namespace", help="Namespace of every object."),
    nproc_per_node: int | None = typer.Option(
        None, "--nproc-per-node", help="Workers per CPU pod (GPU pods: one per GPU)."
    ),
    gpu: str | None = typer.Option(
        None, "--gpu", help="Accelerator (hardware catalog) for the planner's memory check."
    ),
    catalog: list[Path] = typer.Option(None, "--catalog", help="Extra hardware catalog YAML."),
    gpu_product: str | None = typer.Option(
        None, "--gpu-product", help="Node label nvidia.com/gpu.product to ask for."
    ),
    checkpoint_s: float | None = typer.Option(
        None, "--checkpoint-s", help="Seconds one checkpoint takes to save (grace period)."
    ),
    measured_run: Path | None = typer.Option(
        None, "--measured-run", help="A run folder whose measured save time sets the grace period."
    ),
    grace_s: int | None = typer.Option(
        None, "--grace-s", help="terminationGracePeriodSeconds (default: from the save time)."
    ),
    mtbf: str | None = typer.Option(
        None, "--mtbf", help="With train.checkpoint_every 0: checkpoint every Daly interval."
    ),
    max_restarts: int = typer.Option(
        3, "--max-restarts", help="JobSet restarts after a failure (preemptions do not count)."
    ),
    storage: str = typer.Option("100Gi", "--storage", help="Size of the checkpoint claim."),
    storage_class: str | None = typer.Option(
        None, "--storage-class", help="StorageClass of the claim (ReadWriteMany)."
    ),
    shm: str = typer.Option("16Gi", "--shm", help="Size of /dev/shm (memory)."),
    cpu: str | None = typer.Option(None, "--cpu", help="CPU request per pod, e.g. 32."),
    memory: str | None = typer.Option(None, "--memory", help="Memory per pod, e.g. 480Gi."),
    port: int = typer.Option(29500, "--port", help="Rendezvous port on pod 0."),
    metrics_port: int | None = typer.Option(
        None,
        "--metrics-port",
        help="First rank's /metrics port (default observe.metrics_port or 9400).",
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Write Kubernetes manifests for a multi-node training run: a JobSet (or TrainJob), its
    config, a checkpoint claim and a PodMonitor."""
    from hpcml.config import load_config
    from hpcml.launch.k8s import K8sJob, check_name, default_name, write
    from hpcml.launch.k8s_train import render
    from hpcml.models.zoo import get_spec

    if nodes < 1:
        raise LaunchError(f"--nodes {nodes} must be at least 1.")
    if nodes > MAX_NODES or gpus_per_node > MAX_GPUS_PER_NODE:
        raise LaunchError(
            f"--nodes {nodes} x --gpus-per-node {gpus_per_node} is beyond what this writes "
            f"(at most {MAX_NODES} nodes of {MAX_GPUS_PER_NODE} GPUs)."
        )
    overrides = list(overrides or [])
    cfg = load_config(config, overrides)
    get_spec(cfg.model.name)
    job_name = name or default_name(config)
    check_name(job_name, nodes)
    world = nodes * (gpus_per_node or nproc_per_node or 1)
    check_layout(cfg, world, f"--nodes {nodes} x {gpus_per_node or nproc_per_node or 1}")
    fit = check_fit(cfg, world, gpu, catalog or []) if gpu else None
    overrides, grace, grace_source = _grace(
        cfg, overrides, grace_s, checkpoint_s, measured_run, mtbf
    )
    job = K8sJob(
        name=job_name,
        config_text=config.read_text(),
        config_name="config.yaml",
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        image=image,
        nproc_per_node=nproc_per_node,
        queue=queue,
        kind=kind,
        namespace=namespace,
        overrides=overrides,
        rdzv_port=port,
        metrics_port=metrics_port if metrics_port is not None else cfg.observe.metrics_port or 9400,
        grace_s=grace,
        max_restarts=max_restarts,
        storage=storage,
        storage_class=storage_class,
        shm=shm,
        cpu=cpu,
        memory=memory,
        gpu_product=gpu_product,
    )
    paths = write(render(job), out)
    result = {
        "files": [str(p) for p in paths],
        "kind": kind,
        "name": job_name,
        "nodes": nodes,
        "workers_per_node": job.workers_per_node,
        "world_size": job.world_size,
        "queue": queue,
        "termination_grace_s": grace,
        "grace_from": grace_source,
        "planner": None if fit is None else {
            "device": fit.device, "predicted_bytes": fit.predicted_bytes,
            "usable_bytes": fit.usable_bytes,
        },
    }  # fmt: skip
    _report(result, out, json_out)


def _report(result: dict[str, Any], out: Path, json_out: bool) -> None:
    from hpcml.cli.common import console, print_json

    if json_out:
        print_json(result)
        return
    for path in result["files"]:
        console.print(f"wrote {path}")
    for key, value in result.items():
        if key != "files" and value is not None:
            console.print(f"{key}: {value}")
    console.print(f"apply with: kubectl apply -f {out}")


def k8s_serve(
    model: str = typer.Argument(
        ..., help="models:/NAME@ALIAS (followed), models:/NAME/VERSION, or a path in the image."
    ),
    name: str = typer.Option(..., "--name", help="Name of the Deployment / InferenceService."),
    out: Path = typer.Option(..., "--out", help="Folder to write the manifests to."),
    image: str = typer.Option("hpcml:latest", "--image", help="Container image with hpcml."),
    kind: str = typer.Option(
        "deployment", "--kind", help="deployment (with Service and HPA) or inferenceservice."
    ),
    namespace: str | None = typer.Option(None, "--namespace", help="Namespace of every object."),
    min_replicas: int = typer.Option(1, "--min-replicas"),
    max_replicas: int = typer.Option(4, "--max-replicas"),
    queue_target: float = typer.Option(
        8.0, "--queue-target", help="Samples waiting per pod the autoscaler aims at."
    ),
    gpus: int = typer.Option(0, "--gpus", help="nvidia.com/gpu per pod."),
    cpu: str | None = typer.Option(None, "--cpu", help="CPU request per pod."),
    memory: str | None = typer.Option(None, "--memory", help="Memory per pod."),
    tracking_uri: str | None = typer.Option(
        None, "--tracking-uri", help="MLflow server the pods resolve models:/ URIs with."
    ),
    prometheus_url: str = typer.Option(
        "http://prometheus-operated.monitoring.svc:9090",
        "--prometheus-url",
        help="Prometheus KServe's KEDA queries (inferenceservice).",
    ),
    serve_config: Path | None = typer.Option(
        None,
        "--serve-config",
        help="Serve config YAML (batching, limits, the canary of a followed alias), checked "
        "here, shipped in a ConfigMap and passed to each pod's hpcml serve as --config.",
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Write Kubernetes manifests that serve a model: `hpcml serve` with probes on the OIP
    health endpoints, scaled on the batch queue's depth."""
    from hpcml.launch.k8s import write
    from hpcml.launch.k8s_serve import ServeSpec, render
    from hpcml.serve.config import load_serve_config

    if serve_config is not None:
        load_serve_config(serve_config)  # a bad file is one sentence here, not a crashing pod

    spec = ServeSpec(
        name=name,
        model=model,
        image=image,
        kind=kind,
        namespace=namespace,
        min_replicas=min_replicas,
        max_replicas=max_replicas,
        queue_target=queue_target,
        gpus=gpus,
        cpu=cpu,
        memory=memory,
        tracking_uri=tracking_uri,
        prometheus_url=prometheus_url,
        serve_config=serve_config.read_text() if serve_config is not None else None,
    )
    paths = write(render(spec), out, verb="k8s-serve")
    result = {"files": [str(p) for p in paths], "kind": kind, "name": name, "follows": spec.follows}
    _report(result, out, json_out)


def register(app: typer.Typer) -> None:
    """Add `k8s` and `k8s-serve` to `hpcml launch`."""
    app.command("k8s", help=k8s.__doc__)(k8s)
    app.command("k8s-serve", help=k8s_serve.__doc__)(k8s_serve)
