"""Kubernetes manifests for a training run: `hpcml launch k8s CONFIG --nodes N --gpus-per-node G`.

One pod per node runs torchrun's agent (`python -m hpcml.launch.agent`, the same agent as
`hpcml train --nproc` and `launch slurm`) with `hpcml train` in each of its G workers. torchrun
reads its rendezvous from `PET_*` variables: the JobSet's pods get them from the manifest
(static rendezvous at pod 0 through the headless Service that JobSet creates for
`spec.network`, node rank from the Indexed Job's completion index), a Kubeflow Trainer
TrainJob's from its `torch-distributed` runtime, which sets the same variables. Both take
`nvidia.com/gpu` and the GPU Operator's node label and taint, `/dev/shm` in memory, a
ReadWriteMany claim for the run folder (every node writes its checkpoint shards there), Kueue's
queue label for gang admission, and a PodMonitor for the ranks' `/metrics`.

SIGTERM (a Kueue preemption, a node drain) makes the workers save a checkpoint and the agent end;
`terminationGracePeriodSeconds` leaves the save its measured time. The Job fails (pod failure
policy) and the JobSet restarts every pod, which resume (`--resume auto`) from the claim; a
pod that exits 2 (bad input) fails the whole JobSet instead of restarting it.

Everything a user gives is checked before anything is written (`K8sJob`, `check_*`);
`hpcml.launch.k8s_train.render` builds the documents and `write` puts each in its own file.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hpcml import __version__
from hpcml.errors import LaunchError
from hpcml.launch.local import AGENT_SIGNALS

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
"""RFC 1123 label: a Kueue LocalQueue name, a port name, a Service's name."""
RFC1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
"""What a TrainJob's name must match (its CRD's validation rule), and a safe JobSet name."""
QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|m)?$")
"""A Kubernetes resource quantity, e.g. 16Gi, 500m, 8."""

REPLICATED_JOB = "node"
"""The replicated job (and container) name: Kubeflow's torch runtime calls its nodes so too."""
CONFIG_DIR = "/etc/hpcml"
RUN_ROOT = "/checkpoints"
GPU_RESOURCE = "nvidia.com/gpu"
GPU_NODE_LABEL = "nvidia.com/gpu.present"
"""Set by the GPU Operator's feature discovery on nodes that have an NVIDIA GPU."""
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
JOB_LABEL = "hpcml.io/job"
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
BAD_INPUT_EXIT = 2
SIGTERM_EXIT = 128 + 15
"""The agent's exit code after it passed SIGTERM on and the workers saved (`hpcml.launch.agent`)."""
DEFAULT_CHECKPOINT_S = 60.0
"""Assumed save time where no run measured one and --checkpoint-s is not given."""
GRACE_MARGIN_S = 30
"""Seconds beyond the stop agreement and the save: the agent's own shutdown and the kubelet."""


@dataclass
class K8sJob:
    """A training run as Kubernetes sees it; `__post_init__` refuses what cannot be written."""

    name: str
    config_text: str
    config_name: str
    nodes: int
    gpus_per_node: int
    image: str
    nproc_per_node: int | None = None
    """Workers per pod; default one per GPU (1 on CPU nodes)."""
    queue: str | None = None
    kind: str = "jobset"
    namespace: str | None = None
    overrides: list[str] = field(default_factory=list)
    rdzv_port: int = 29500
    metrics_port: int = 9400
    grace_s: int = 120
    max_restarts: int = 3
    storage: str = "100Gi"
    storage_class: str | None = None
    shm: str = "16Gi"
    cpu: str | None = None
    memory: str | None = None
    gpu_product: str | None = None

    def __post_init__(self) -> None:
        check_name(self.name, self.nodes)
        if self.nodes < 1:
            raise LaunchError(f"--nodes {self.nodes} must be at least 1.")
        if self.kind not in ("jobset", "trainjob"):
            raise LaunchError(f"--kind {self.kind!r} is not jobset or trainjob.")
        if self.queue is not None:
            check_queue(self.queue)
        if self.namespace is not None and not DNS_LABEL.fullmatch(self.namespace):
            raise LaunchError(
                f"--namespace {self.namespace!r} is not a Kubernetes namespace name (lowercase "
                "letters, digits and '-', at most 63); choose another."
            )
        for flag, value in (
            ("--storage", self.storage),
            ("--shm", self.shm),
            ("--cpu", self.cpu),
            ("--memory", self.memory),
        ):
            if value is not None and not QUANTITY.fullmatch(value):
                raise LaunchError(
                    f"{flag} {value!r} is not a Kubernetes quantity; write e.g. 16Gi, 500m or 8."
                )
        if self.nproc_per_node is not None and self.nproc_per_node < 1:
            raise LaunchError(f"--nproc-per-node {self.nproc_per_node} must be at least 1.")
        if self.gpus_per_node and self.nproc_per_node not in (None, self.gpus_per_node):
            raise LaunchError(
                f"--nproc-per-node {self.nproc_per_node} differs from --gpus-per-node "
                f"{self.gpus_per_node}: each worker drives one GPU; leave out --nproc-per-node."
            )
        for flag, port in (("--port", self.rdzv_port), ("--metrics-port", self.metrics_port)):
            if not 1024 <= port <= 65535 - self.workers_per_node:
                raise LaunchError(f"{flag} {port} is not a free port number in 1024-65535.")
        if abs(self.rdzv_port - self.metrics_port) < self.workers_per_node:
            raise LaunchError(
                f"--port {self.rdzv_port} falls among the ranks' metrics ports "
                f"({self.metrics_port}-{self.metrics_port + self.workers_per_node - 1}); "
                "choose another --port or --metrics-port."
            )

    @property
    def workers_per_node(self) -> int:
        return self.nproc_per_node or self.gpus_per_node or 1

    @property
    def world_size(self) -> int:
        return self.nodes * self.workers_per_node

    @property
    def run_dir(self) -> str:
        return f"{RUN_ROOT}/{self.name}"

    @property
    def master_addr(self) -> str:
        """Pod 0's name in the headless Service JobSet makes: <jobset>-<job>-<index>-<pod>.<subdomain>."""
        return f"{self.name}-{REPLICATED_JOB}-0-0.{self.name}"


def check_name(name: str, nodes: int) -> None:
    """A name that a JobSet, a TrainJob and their pods' host names can all carry."""
    longest = f"{name}-{REPLICATED_JOB}-0-{max(nodes - 1, 0)}"
    if not RFC1035_LABEL.fullmatch(name) or len(longest) > 63:
        raise LaunchError(
            f"job name {name!r} cannot name a JobSet and its pods (lowercase letters, digits "
            f"and '-', starting with a letter, and '{longest}' at most 63 characters); pass "
            "--name with a shorter name."
        )


def check_queue(queue: str) -> None:
    if not DNS_LABEL.fullmatch(queue) or len(queue) > 63:
        raise LaunchError(
            f"--queue {queue!r} is not a DNS label, which a Kueue LocalQueue name is (lowercase "
            "letters, digits and '-', starting and ending with a letter or digit, at most 63); "
            "give the name of a LocalQueue in the job's namespace."
        )


def default_name(config: Path) -> str:
    """The config file's stem as a DNS label: `GPT Small_v2.yaml` -> `gpt-small-v2`."""
    name = re.sub(r"[^a-z0-9-]+", "-", config.stem.lower()).strip("-")
    name = re.sub(r"^[^a-z]+", "", name)
    return name[:40].rstrip("-") or "hpcml"


def grace_seconds(stop_check_s: float, checkpoint_s: float) -> int:
    """terminationGracePeriodSeconds: the ranks agree on the stop within `stop_check_s`, then
    save (`checkpoint_s`, measured or given); 1.5x the save for a shared volume slower than where
    it was measured, and GRACE_MARGIN_S for the agent's shutdown."""
    return int(math.ceil(stop_check_s + 1.5 * checkpoint_s)) + GRACE_MARGIN_S


def object_metadata(job: K8sJob, name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "labels": {
            "app.kubernetes.io/name": "hpcml",
            "app.kubernetes.io/managed-by": "hpcml",
            JOB_LABEL: job.name,
            **(labels or {}),
        },
    }
    if job.namespace:
        meta["namespace"] = job.namespace
    return meta


def train_args(job: K8sJob) -> list[str]:
    """What follows `python -m hpcml.launch.agent` in every pod (torchrun's own arguments come
    from PET_* variables)."""
    return [
        "-m", "hpcml", "train", f"{CONFIG_DIR}/{job.config_name}", *job.overrides,
        f"observe.metrics_port={job.metrics_port}",
        "--run-dir", job.run_dir, "--resume", "auto", "--quiet",
    ]  # fmt: skip


def agent_env(job: K8sJob) -> list[dict[str, Any]]:
    """Variables every pod's agent reads, whichever kind started it: pass SIGTERM on to the
    workers and give their checkpoint the grace period (less a margin) before SIGKILL."""
    shutdown = max(10, job.grace_s - GRACE_MARGIN_S // 2)
    env = [
        {"name": "PET_SIGNALS_TO_HANDLE", "value": AGENT_SIGNALS},
        {"name": "TORCHELASTIC_SIGNALS_TO_HANDLE", "value": AGENT_SIGNALS},
        {"name": "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "value": str(shutdown)},
        {"name": "PET_MAX_RESTARTS", "value": "0"},  # the JobSet restarts every pod together
    ]
    if job.cpu:
        threads = max(1, int(float(job.cpu.rstrip("m")) / (1000 if job.cpu.endswith("m") else 1)))
        env.append(
            {"name": "OMP_NUM_THREADS", "value": str(max(1, threads // job.workers_per_node))}
        )
    return env


def rendezvous_env(job: K8sJob) -> list[dict[str, Any]]:
    """torchrun's static rendezvous at pod 0 (what Kubeflow's torch runtime sets for a TrainJob)."""
    return [
        {"name": "PET_NNODES", "value": str(job.nodes)},
        {"name": "PET_NPROC_PER_NODE", "value": str(job.workers_per_node)},
        {"name": "PET_NODE_RANK", "valueFrom": {"fieldRef": {"fieldPath": COMPLETION_INDEX}}},
        {"name": "PET_MASTER_ADDR", "value": job.master_addr},
        {"name": "PET_MASTER_PORT", "value": str(job.rdzv_port)},
    ]


def pod_volumes(job: K8sJob) -> list[dict[str, Any]]:
    return [
        {"name": "config", "configMap": {"name": f"{job.name}-config"}},
        {"name": "checkpoints", "persistentVolumeClaim": {"claimName": f"{job.name}-checkpoints"}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": job.shm}},
    ]


def pod_mounts() -> list[dict[str, Any]]:
    return [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "checkpoints", "mountPath": RUN_ROOT},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]


def pod_resources(job: K8sJob) -> dict[str, Any]:
    requests = {k: v for k, v in (("cpu", job.cpu), ("memory", job.memory)) if v}
    limits: dict[str, Any] = {"memory": job.memory} if job.memory else {}
    if job.gpus_per_node:
        limits[GPU_RESOURCE] = job.gpus_per_node
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def pod_placement(job: K8sJob) -> dict[str, Any]:
    """GPU Operator node label (and a product, if asked) and its taint's toleration."""
    if not job.gpus_per_node:
        return {}
    selector = {GPU_NODE_LABEL: "true"}
    if job.gpu_product:
        selector[GPU_PRODUCT_LABEL] = job.gpu_product
    return {
        "nodeSelector": selector,
        "tolerations": [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}],
    }


POD_SECURITY = {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000}
"""The image's user (Dockerfile); fsGroup lets it write the checkpoint claim."""


HEADER = (
    "# Written by `hpcml launch {verb}` (hpcml {version}); apply with: kubectl apply -f {out}\n"
)


def write(docs: dict[str, dict[str, Any]], out: Path, verb: str = "k8s") -> list[Path]:
    """Every document to its own file under `out`, rendered in full before the first is written."""
    texts = {
        name: HEADER.format(verb=verb, version=__version__, out=out)
        + yaml.safe_dump(doc, sort_keys=False, width=100)
        for name, doc in docs.items()
    }
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in texts.items():
        path = out / name
        path.write_text(text)
        paths.append(path)
    return paths
