"""Kubernetes manifests for serving: `hpcml launch k8s-serve MODEL --name NAME`.

Either a Deployment + Service + HorizontalPodAutoscaler (kind `deployment`) or a KServe
InferenceService (kind `inferenceservice`, Standard deployment mode scaled by KEDA). The pods
run `hpcml serve MODEL` (with `--follow` for a `models:/NAME@ALIAS` URI, so a promotion reaches
them without a restart) on the Open Inference Protocol's port; the startup, readiness and
liveness probes are its `/v2/health/ready` and `/v2/health/live`; `--serve-config` ships a
serve config (batching, the canary of a followed alias) in a ConfigMap. Both autoscalers scale on
`hpcml_queue_depth`, the samples waiting in the batch queue that every server exports on
`/metrics`: the HPA reads it as a Pods metric (served by prometheus-adapter), KServe's KEDA by
a Prometheus query.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from hpcml.errors import LaunchError
from hpcml.launch.k8s import (
    DNS_LABEL,
    GPU_NODE_LABEL,
    GPU_RESOURCE,
    JOB_LABEL,
    POD_SECURITY,
    QUANTITY,
    RFC1035_LABEL,
)

QUEUE_METRIC = "hpcml_queue_depth"
SERVE_CONFIG_DIR = "/etc/hpcml-serve"
SERVE_CONFIG_FILE = "serve.yaml"
SERVE_PORT = 8080
"""KServe's container port; the Deployment uses the same so the two kinds read alike."""
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass
class ServeSpec:
    name: str
    model: str
    image: str
    kind: str = "deployment"
    namespace: str | None = None
    min_replicas: int = 1
    max_replicas: int = 4
    queue_target: float = 8.0
    """Mean samples waiting per pod the autoscaler aims at."""
    gpus: int = 0
    cpu: str | None = None
    memory: str | None = None
    tracking_uri: str | None = None
    """MLFLOW_TRACKING_URI for a models:/ URI (a Secret is better for credentials; see the guide)."""
    poll_s: float = 10.0
    prometheus_url: str = "http://prometheus-operated.monitoring.svc:9090"
    serve_config: str | None = None
    """The text of a checked serve config (batching, canary, ...): a ConfigMap mounted into
    each pod at SERVE_CONFIG_DIR and passed as `--config`."""

    def __post_init__(self) -> None:
        if not RFC1035_LABEL.fullmatch(self.name) or len(self.name) > 45:
            raise LaunchError(
                f"--name {self.name!r} cannot name a Deployment and its Service (lowercase "
                "letters, digits and '-', starting with a letter, at most 45 characters)."
            )
        if self.kind not in ("deployment", "inferenceservice"):
            raise LaunchError(f"--kind {self.kind!r} is not deployment or inferenceservice.")
        if self.namespace is not None and not DNS_LABEL.fullmatch(self.namespace):
            raise LaunchError(f"--namespace {self.namespace!r} is not a namespace name.")
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise LaunchError(
                f"--min-replicas {self.min_replicas} and --max-replicas {self.max_replicas} "
                "must satisfy 1 <= min <= max."
            )
        if self.queue_target <= 0:
            raise LaunchError(f"--queue-target {self.queue_target} must be above 0.")
        for flag, value in (("--cpu", self.cpu), ("--memory", self.memory)):
            if value is not None and not QUANTITY.fullmatch(value):
                raise LaunchError(
                    f"{flag} {value!r} is not a Kubernetes quantity; write e.g. 4, 500m or 8Gi."
                )
        if self.model.startswith("models:/") and not self.tracking_uri:
            raise LaunchError(
                f"{self.model} is a registry URI: pass --tracking-uri (the MLflow server the "
                "pods reach) so they can resolve it."
            )

    @property
    def follows(self) -> bool:
        return self.model.startswith("models:/") and "@" in self.model


def serve_args(spec: ServeSpec) -> list[str]:
    args = ["serve", spec.model, "--host", "0.0.0.0", "--port", str(SERVE_PORT)]
    if spec.follows:
        args += ["--follow", "--poll-s", f"{spec.poll_s:g}"]
    if spec.serve_config is not None:
        args += ["--config", f"{SERVE_CONFIG_DIR}/{SERVE_CONFIG_FILE}"]
    return args


def config_map(spec: ServeSpec) -> dict[str, Any]:
    assert spec.serve_config is not None
    meta = _meta(spec)
    meta["name"] = f"{spec.name}-serve-config"
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta,
        "data": {SERVE_CONFIG_FILE: spec.serve_config},
    }


def _config_volume(spec: ServeSpec) -> dict[str, Any]:
    """The pod's volume holding the serve config, if there is one."""
    if spec.serve_config is None:
        return {}
    return {
        "volumes": [{"name": "serve-config", "configMap": {"name": f"{spec.name}-serve-config"}}]
    }


def _probes() -> dict[str, Any]:
    """Startup waits for the model to load (up to 10 min); readiness takes a pod out of the
    Service while it cannot answer (overload, a version switching); liveness restarts a hung one."""

    def get(path: str) -> dict[str, Any]:
        return {"httpGet": {"path": path, "port": "http"}}

    return {
        "startupProbe": {**get("/v2/health/ready"), "periodSeconds": 5, "failureThreshold": 120},
        "readinessProbe": {**get("/v2/health/ready"), "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {**get("/v2/health/live"), "periodSeconds": 10, "failureThreshold": 3},
    }


def _resources(spec: ServeSpec) -> dict[str, Any]:
    out: dict[str, Any] = {}
    requests = {k: v for k, v in (("cpu", spec.cpu), ("memory", spec.memory)) if v}
    limits: dict[str, Any] = {"memory": spec.memory} if spec.memory else {}
    if spec.gpus:
        limits[GPU_RESOURCE] = spec.gpus
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _container(spec: ServeSpec, name: str) -> dict[str, Any]:
    c: dict[str, Any] = {
        "name": name,
        "image": spec.image,
        "args": serve_args(spec),
        "ports": [{"name": "http", "containerPort": SERVE_PORT, "protocol": "TCP"}],
        **_probes(),
    }
    if spec.tracking_uri:
        c["env"] = [{"name": "MLFLOW_TRACKING_URI", "value": spec.tracking_uri}]
    if spec.serve_config is not None:
        c["volumeMounts"] = [
            {"name": "serve-config", "mountPath": SERVE_CONFIG_DIR, "readOnly": True}
        ]
    if _resources(spec):
        c["resources"] = _resources(spec)
    return c


def _meta(spec: ServeSpec, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": spec.name, "labels": _labels(spec)}
    if spec.namespace:
        meta["namespace"] = spec.namespace
    if annotations:
        meta["annotations"] = annotations
    return meta


def _labels(spec: ServeSpec) -> dict[str, str]:
    return {"app.kubernetes.io/name": "hpcml-serve", JOB_LABEL: spec.name}


def _placement(spec: ServeSpec) -> dict[str, Any]:
    if not spec.gpus:
        return {}
    return {
        "nodeSelector": {GPU_NODE_LABEL: "true"},
        "tolerations": [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}],
    }


def deployment(spec: ServeSpec) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(spec),
        "spec": {
            "replicas": spec.min_replicas,
            "selector": {"matchLabels": _labels(spec)},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
            },
            "template": {
                "metadata": {
                    "labels": _labels(spec),
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(SERVE_PORT),
                        "prometheus.io/path": "/metrics",
                    },
                },
                "spec": {
                    "securityContext": POD_SECURITY,
                    # hpcml serve drains in-flight requests on SIGTERM.
                    "terminationGracePeriodSeconds": 30,
                    **_placement(spec),
                    "containers": [_container(spec, "server")],
                    **_config_volume(spec),
                },
            },
        },
    }


def service(spec: ServeSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(spec),
        "spec": {
            "selector": _labels(spec),
            "ports": [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def autoscaler(spec: ServeSpec) -> dict[str, Any]:
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": _meta(spec),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": spec.name},
            "minReplicas": spec.min_replicas,
            "maxReplicas": spec.max_replicas,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": QUEUE_METRIC},
                        "target": {
                            "type": "AverageValue",
                            "averageValue": _quantity(spec.queue_target),
                        },
                    },
                }
            ],
        },
    }


def _quantity(value: float) -> str:
    """A float as a Kubernetes quantity string (milli-units where it is not whole)."""
    return str(int(value)) if value == int(value) else f"{round(value * 1000)}m"


def inference_service(spec: ServeSpec) -> dict[str, Any]:
    ns = spec.namespace or "default"
    query = f'sum({QUEUE_METRIC}{{namespace="{ns}",pod=~"{spec.name}-predictor-.*"}})'
    predictor: dict[str, Any] = {
        "minReplicas": spec.min_replicas,
        "maxReplicas": spec.max_replicas,
        "securityContext": POD_SECURITY,
        **_placement(spec),
        "containers": [_container(spec, "kserve-container")],
        **_config_volume(spec),
        "autoScaling": {
            "metrics": [
                {
                    "type": "External",
                    "external": {
                        "metric": {
                            "backend": "prometheus",
                            "serverAddress": spec.prometheus_url,
                            "query": query,
                        },
                        "target": {
                            "type": "AverageValue",
                            "averageValue": _quantity(spec.queue_target),
                        },
                    },
                }
            ]
        },
    }
    annotations = {
        "serving.kserve.io/deploymentMode": "Standard",
        "serving.kserve.io/autoscalerClass": "keda",
    }
    return {
        "apiVersion": "serving.kserve.io/v1beta1",
        "kind": "InferenceService",
        "metadata": _meta(spec, annotations),
        "spec": {"predictor": predictor},
    }


def render(spec: ServeSpec) -> dict[str, dict[str, Any]]:
    # The ConfigMap's file sorts first, so `kubectl apply -f DIR` creates it before the pods.
    docs = {"00-config.yaml": config_map(spec)} if spec.serve_config is not None else {}
    if spec.kind == "inferenceservice":
        return {**docs, "00-inferenceservice.yaml": inference_service(spec)}
    return {
        **docs,
        "00-deployment.yaml": deployment(spec),
        "01-service.yaml": service(spec),
        "02-hpa.yaml": autoscaler(spec),
    }
