"""The training job's Kubernetes objects (`hpcml launch k8s`): the JobSet or TrainJob, the
config's ConfigMap, the checkpoint claim and the PodMonitor, from a checked `K8sJob`
(`hpcml.launch.k8s`, whose docstring says how the pods start, rendezvous and restart)."""

from __future__ import annotations

from typing import Any

from hpcml.errors import REQUEUE_EXIT_CODE
from hpcml.launch.k8s import (
    BAD_INPUT_EXIT,
    JOB_LABEL,
    POD_SECURITY,
    QUEUE_LABEL,
    REPLICATED_JOB,
    SIGTERM_EXIT,
    K8sJob,
    agent_env,
    object_metadata,
    pod_mounts,
    pod_placement,
    pod_resources,
    pod_volumes,
    rendezvous_env,
    train_args,
)


def _container(job: K8sJob) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": REPLICATED_JOB,
        "image": job.image,
        "command": ["python", "-m", "hpcml.launch.agent"],
        "args": train_args(job),
        "env": rendezvous_env(job) + agent_env(job),
        "ports": [
            {"name": f"rank-{i}", "containerPort": job.metrics_port + i, "protocol": "TCP"}
            for i in range(job.workers_per_node)
        ]
        + [{"name": "rendezvous", "containerPort": job.rdzv_port, "protocol": "TCP"}],
        "volumeMounts": pod_mounts(),
    }
    if pod_resources(job):
        container["resources"] = pod_resources(job)
    return container


def _pod_failure_policy() -> dict[str, Any]:
    """Exit 2 (bad input) and a saved preemption fail the Job at once, each by its own rule,
    so the JobSet's rules below can tell them apart by the Job's failure message."""
    return {
        "rules": [
            {
                "action": "FailJob",
                "onExitCodes": {
                    "containerName": REPLICATED_JOB,
                    "operator": "In",
                    "values": [BAD_INPUT_EXIT],
                },
            },
            {
                "action": "FailJob",
                "onExitCodes": {
                    "containerName": REPLICATED_JOB,
                    "operator": "In",
                    "values": [REQUEUE_EXIT_CODE, SIGTERM_EXIT],
                },
            },
            {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        ]
    }


def _failure_policy(job: K8sJob) -> dict[str, Any]:
    """Bad input ends the JobSet; a preemption restarts it without spending a restart; any other
    failure restarts it up to --max-restarts times (every pod resumes from the claim)."""
    return {
        "maxRestarts": job.max_restarts,
        "rules": [
            {
                "name": "badInput",
                "action": "FailJobSet",
                "onJobFailureReasons": ["PodFailurePolicy"],
                "onJobFailureMessagePatterns": ["matching FailJob rule at index 0"],
            },
            {
                "name": "preempted",
                "action": "RestartJobSetAndIgnoreMaxRestarts",
                "onJobFailureReasons": ["PodFailurePolicy"],
                "onJobFailureMessagePatterns": ["matching FailJob rule at index [12]"],
            },
        ],
    }


def _pod_labels(job: K8sJob) -> dict[str, str]:
    return {"app.kubernetes.io/name": "hpcml", JOB_LABEL: job.name}


def jobset(job: K8sJob) -> dict[str, Any]:
    pod_spec = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": job.grace_s,
        "securityContext": POD_SECURITY,
        **pod_placement(job),
        "containers": [_container(job)],
        "volumes": pod_volumes(job),
    }
    labels = {QUEUE_LABEL: job.queue} if job.queue else {}
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": object_metadata(job, job.name, labels),
        "spec": {
            "network": {"enableDNSHostnames": True, "subdomain": job.name},
            "failurePolicy": _failure_policy(job),
            "successPolicy": {"operator": "All"},
            "replicatedJobs": [
                {
                    "name": REPLICATED_JOB,
                    "replicas": 1,
                    "template": {
                        "spec": {
                            "parallelism": job.nodes,
                            "completions": job.nodes,
                            "completionMode": "Indexed",
                            "backoffLimit": 0,
                            "podFailurePolicy": _pod_failure_policy(),
                            "template": {
                                "metadata": {"labels": _pod_labels(job)},
                                "spec": pod_spec,
                            },
                        }
                    },
                }
            ],
        },
    }


def trainjob(job: K8sJob) -> dict[str, Any]:
    """Kubeflow Trainer v2: the `torch-distributed` ClusterTrainingRuntime runs the nodes and
    sets their PET_* rendezvous; what it does not carry (GPU placement, volumes, grace period,
    labels) goes in a runtime patch of its `node` job."""
    pod_patch: dict[str, Any] = {
        "terminationGracePeriodSeconds": job.grace_s,
        "securityContext": POD_SECURITY,
        **pod_placement(job),
        "volumes": pod_volumes(job),
        "containers": [{"name": REPLICATED_JOB, "volumeMounts": pod_mounts()}],
    }
    labels = {QUEUE_LABEL: job.queue} if job.queue else {}
    trainer: dict[str, Any] = {
        "image": job.image,
        "command": ["python", "-m", "hpcml.launch.agent", *train_args(job)],
        "env": agent_env(job),
        "numNodes": job.nodes,
        "numProcPerNode": job.workers_per_node,
    }
    if pod_resources(job):
        trainer["resourcesPerNode"] = pod_resources(job)
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": object_metadata(job, job.name, labels),
        "spec": {
            "runtimeRef": {
                "apiGroup": "trainer.kubeflow.org",
                "kind": "ClusterTrainingRuntime",
                "name": "torch-distributed",
            },
            "trainer": trainer,
            "runtimePatches": [
                {
                    "manager": "hpcml",
                    "trainingRuntimeSpec": {
                        "template": {
                            "spec": {
                                "replicatedJobs": [
                                    {
                                        "name": REPLICATED_JOB,
                                        "template": {
                                            "spec": {
                                                "template": {
                                                    "metadata": {"labels": _pod_labels(job)},
                                                    "spec": pod_patch,
                                                }
                                            }
                                        },
                                    }
                                ]
                            }
                        }
                    },
                }
            ],
        },
    }


def config_map(job: K8sJob) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": object_metadata(job, f"{job.name}-config"),
        "data": {job.config_name: job.config_text},
    }


def checkpoint_claim(job: K8sJob) -> dict[str, Any]:
    """ReadWriteMany: every node writes its shards of a checkpoint into the one run folder."""
    spec: dict[str, Any] = {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": job.storage}},
    }
    if job.storage_class:
        spec["storageClassName"] = job.storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": object_metadata(job, f"{job.name}-checkpoints"),
        "spec": spec,
    }


def pod_monitor(job: K8sJob) -> dict[str, Any]:
    """One scrape endpoint per local rank (`observe.metrics_port` + local rank). A TrainJob's
    containers declare no ports (its runtime patch cannot add them), so there the address is
    rewritten to the rank's port instead."""
    endpoints = []
    for i in range(job.workers_per_node):
        port = job.metrics_port + i
        ep: dict[str, Any] = {"path": "/metrics", "interval": "15s"}
        if job.kind == "jobset":
            ep["port"] = f"rank-{i}"
        else:
            ep["relabelings"] = [
                {
                    "sourceLabels": ["__meta_kubernetes_pod_ip"],
                    "targetLabel": "__address__",
                    "replacement": f"$1:{port}",
                    "action": "replace",
                }
            ]
        endpoints.append(ep)
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": object_metadata(job, f"{job.name}-ranks"),
        "spec": {
            "selector": {"matchLabels": {JOB_LABEL: job.name}},
            "podMetricsEndpoints": endpoints,
        },
    }


def render(job: K8sJob) -> dict[str, dict[str, Any]]:
    """File name -> document, in the order `kubectl apply -f DIR` should see them."""
    workload = jobset(job) if job.kind == "jobset" else trainjob(job)
    return {
        "00-configmap.yaml": config_map(job),
        "01-checkpoints-pvc.yaml": checkpoint_claim(job),
        f"02-{job.kind}.yaml": workload,
        "03-podmonitor.yaml": pod_monitor(job),
    }
