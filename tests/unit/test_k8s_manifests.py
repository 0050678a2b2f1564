"""`hpcml launch k8s` and `k8s-serve` manifests validated offline (no API server runs here):
core kinds with kubernetes-validate --strict against the Kubernetes version's own schemas, the
CRDs (JobSet, TrainJob, InferenceService, PodMonitor) against their published schemas vendored
in tests/k8s_schemas (SOURCES.json: version, URL, sha256), made strict the way the API server
prunes (an unknown field is an error). Then what the manifests mean: a pod per node with the
GPUs, the GPU Operator's label and taint, /dev/shm in memory, the claim, the queue label, the
grace period from the save time, the PodMonitor reaching every rank's port; and bad input
refused in one sentence with nothing written."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from tests.conftest import ROOT, run_hpcml

from hpcml.launch.k8s import grace_seconds

SCHEMAS = ROOT / "tests" / "k8s_schemas"
K8S_VERSION = "1.33.0"
"""The Kubernetes version validated against (kubernetes-validate carries its schemas)."""
CRD_KINDS = {"JobSet", "TrainJob", "InferenceService", "PodMonitor"}
DIGITS = str(ROOT / "examples" / "digits_cnn.yaml")


def crd_errors(doc: dict[str, Any]) -> list[str]:
    schema = json.loads((SCHEMAS / f"{doc['kind']}.json").read_text())
    validator = jsonschema.Draft4Validator(schema)
    return [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)
    ]


def validate(doc: dict[str, Any]) -> None:
    """A core kind by kubernetes-validate (strict), a CRD by its vendored schema."""
    if doc["kind"] in CRD_KINDS:
        assert crd_errors(doc) == []
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def load_dir(out: Path) -> dict[str, dict[str, Any]]:
    docs = {}
    for path in sorted(out.glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        docs[doc["kind"]] = doc
    return docs


def launch(tmp_path: Path, *args: str) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    out = tmp_path / "k8s"
    proc = run_hpcml("launch", "k8s", DIGITS, *args, "--out", str(out), "--json", cwd=tmp_path)
    return load_dir(out), json.loads(proc.stdout)


def test_vendored_schemas_say_where_they_come_from() -> None:
    sources = json.loads((SCHEMAS / "SOURCES.json").read_text())
    assert {s["kind"] for s in sources} == CRD_KINDS
    for s in sources:
        assert s["url"].startswith("https://") and s["version"] in s["url"]
        assert len(s["sha256"]) == 64
        assert (SCHEMAS / f"{s['kind']}.json").exists()


def test_jobset_manifests_are_valid_and_carry_the_job(tmp_path: Path) -> None:
    docs, result = launch(
        tmp_path, "--nodes", "2", "--gpus-per-node", "8", "--queue", "team-a",
        "--name", "digits", "--checkpoint-s", "20", "--gpu-product", "NVIDIA-H100-80GB-HBM3",
    )  # fmt: skip
    assert set(docs) == {"ConfigMap", "PersistentVolumeClaim", "JobSet", "PodMonitor"}
    for doc in docs.values():
        validate(doc)
    js = docs["JobSet"]
    job = js["spec"]["replicatedJobs"][0]["template"]
    # The Job and its pod template against the official batch/v1 and v1 schemas as well.
    kubernetes_validate.validate(
        {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x"}, **job},
        K8S_VERSION,
        strict=True,
    )
    pod = job["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}
    assert job["spec"]["parallelism"] == job["spec"]["completions"] == 2
    assert job["spec"]["completionMode"] == "Indexed"
    assert js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert js["spec"]["network"] == {"enableDNSHostnames": True, "subdomain": "digits"}
    # Pod 0 by its name in the headless service: <jobset>-<replicated job>-<job index>-<pod index>.
    assert env["PET_MASTER_ADDR"] == "digits-node-0-0.digits"
    assert env["PET_NNODES"] == "2" and env["PET_NPROC_PER_NODE"] == "8"
    assert "job-completion-index" in env["PET_NODE_RANK"]["fieldRef"]["fieldPath"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert pod["nodeSelector"] == {
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
    }
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    claim = volumes[mounts["/checkpoints"]]["persistentVolumeClaim"]["claimName"]
    assert claim == docs["PersistentVolumeClaim"]["metadata"]["name"]
    assert docs["PersistentVolumeClaim"]["spec"]["accessModes"] == ["ReadWriteMany"]
    config = volumes[mounts["/etc/hpcml"]]["configMap"]["name"]
    assert config == docs["ConfigMap"]["metadata"]["name"]
    assert docs["ConfigMap"]["data"]["config.yaml"] == Path(DIGITS).read_text()
    assert c["args"][:4] == ["-m", "hpcml", "train", "/etc/hpcml/config.yaml"]
    assert c["args"][-5:] == ["--run-dir", "/checkpoints/digits", "--resume", "auto", "--quiet"]
    # Grace: the stop agreement (fault.stop_check_s, 5 s by default) and the given save.
    assert (
        pod["terminationGracePeriodSeconds"]
        == grace_seconds(5.0, 20.0)
        == result["termination_grace_s"]
    )
    # The agent waits for the workers' save within the grace period, not its own 30 s default.
    assert int(env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]) < pod["terminationGracePeriodSeconds"]
    assert "SIGTERM" in env["PET_SIGNALS_TO_HANDLE"]
    # Every rank's /metrics port is declared and scraped by the PodMonitor.
    pm = docs["PodMonitor"]["spec"]
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert pm["selector"]["matchLabels"].items() <= labels.items()
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    scraped = [ports[e["port"]] for e in pm["podMetricsEndpoints"]]
    assert scraped == list(range(9400, 9408))
    assert "observe.metrics_port=9400" in c["args"]
    # Bad input (exit 2) ends the JobSet; a saved preemption restarts it without counting.
    rules = job["spec"]["podFailurePolicy"]["rules"]
    assert rules[0]["onExitCodes"]["values"] == [2]
    assert set(rules[1]["onExitCodes"]["values"]) == {75, 143}
    fp = js["spec"]["failurePolicy"]["rules"]
    assert [r["action"] for r in fp] == ["FailJobSet", "RestartJobSetAndIgnoreMaxRestarts"]


def test_strict_validation_refuses_a_misspelt_field(tmp_path: Path) -> None:
    """The check above can fail: a field the API server would prune silently is an error."""
    docs, _ = launch(tmp_path, "--nodes", "1", "--gpus-per-node", "1")
    js = copy.deepcopy(docs["JobSet"])
    pod = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    pod["terminationGracePeriodSecond"] = pod.pop("terminationGracePeriodSeconds")
    assert any("terminationGracePeriodSecond" in e for e in crd_errors(js))
    pvc = copy.deepcopy(docs["PersistentVolumeClaim"])
    pvc["spec"]["accesModes"] = pvc["spec"].pop("accessModes")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pvc, K8S_VERSION, strict=True)


def test_trainjob_manifests_are_valid(tmp_path: Path) -> None:
    docs, _ = launch(
        tmp_path, "--nodes", "4", "--gpus-per-node", "2", "--kind", "trainjob", "--queue", "q1",
        "--name", "digits",
    )  # fmt: skip
    assert set(docs) == {"ConfigMap", "PersistentVolumeClaim", "TrainJob", "PodMonitor"}
    for doc in docs.values():
        validate(doc)
    tj = docs["TrainJob"]
    assert tj["spec"]["runtimeRef"]["name"] == "torch-distributed"
    assert tj["spec"]["trainer"]["numNodes"] == 4
    assert tj["spec"]["trainer"]["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == 2
    assert tj["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "q1"
    (patch,) = tj["spec"]["runtimePatches"]
    job = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    pod = job["template"]["spec"]["template"]["spec"]
    assert {v["name"] for v in pod["volumes"]} == {"config", "checkpoints", "dshm"}
    # No declared ports in a TrainJob: each endpoint rewrites the address to its rank's port.
    eps = docs["PodMonitor"]["spec"]["podMetricsEndpoints"]
    assert [e["relabelings"][0]["replacement"] for e in eps] == ["$1:9400", "$1:9401"]


SERVE_CONFIG = "defaults:\n  canary: {steps: [0.1, 1.0], max_p99_ms: 250}\n"


@pytest.mark.parametrize("kind", ["deployment", "inferenceservice"])
def test_serve_manifests_are_valid(tmp_path: Path, kind: str) -> None:
    out = tmp_path / "serve"
    (tmp_path / "serve.yaml").write_text(SERVE_CONFIG)
    run_hpcml(
        "launch", "k8s-serve", "models:/digits@production", "--name", "digits", "--kind", kind,
        "--tracking-uri", "http://mlflow.mlops.svc:5000", "--max-replicas", "6",
        "--serve-config", str(tmp_path / "serve.yaml"), "--out", str(out), cwd=tmp_path,
    )  # fmt: skip
    docs = load_dir(out)
    for doc in docs.values():
        validate(doc)
    if kind == "inferenceservice":
        pod = pred = docs["InferenceService"]["spec"]["predictor"]
        (c,) = pred["containers"]
        (metric,) = pred["autoScaling"]["metrics"]
        assert "hpcml_queue_depth" in metric["external"]["metric"]["query"]
    else:
        assert set(docs) == {"ConfigMap", "Deployment", "Service", "HorizontalPodAutoscaler"}
        pod = docs["Deployment"]["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        hpa = docs["HorizontalPodAutoscaler"]["spec"]
        assert hpa["maxReplicas"] == 6
        assert hpa["metrics"][0]["pods"]["metric"]["name"] == "hpcml_queue_depth"
        assert (
            docs["Service"]["spec"]["selector"]
            == docs["Deployment"]["spec"]["selector"]["matchLabels"]
        )
    assert c["args"][:2] == ["serve", "models:/digits@production"]
    assert "--follow" in c["args"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert c["startupProbe"]["httpGet"]["path"] == "/v2/health/ready"
    # The serve config (here a canary) reaches hpcml serve through a ConfigMap volume.
    assert docs["ConfigMap"]["data"] == {"serve.yaml": SERVE_CONFIG}
    assert c["args"][-2:] == ["--config", "/etc/hpcml-serve/serve.yaml"]
    (mount,) = c["volumeMounts"]
    (volume,) = pod["volumes"]
    assert mount["mountPath"] == "/etc/hpcml-serve" and mount["name"] == volume["name"]
    assert volume["configMap"]["name"] == docs["ConfigMap"]["metadata"]["name"]


def test_a_bad_serve_config_is_one_sentence_and_writes_nothing(tmp_path: Path) -> None:
    (tmp_path / "serve.yaml").write_text("defaults:\n  canary: {steps: [0.5, 0.2]}\n")
    out = tmp_path / "serve"
    proc = run_hpcml(
        "launch", "k8s-serve", "models:/digits@production", "--name", "digits",
        "--tracking-uri", "http://mlflow.mlops.svc:5000", "--serve-config",
        str(tmp_path / "serve.yaml"), "--out", str(out), cwd=tmp_path, check=False,
    )  # fmt: skip
    assert proc.returncode == 2 and "canary steps must increase" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


BAD = [
    # GPUs that do not divide the job: tp 3 over 2 x 2 processes.
    (["--nodes", "2", "--gpus-per-node", "2", "parallel.tp=3"], "parallel.tp 3"),
    # A global batch that 3 data-parallel ranks of batch 32 cannot make.
    (["--nodes", "3", "--gpus-per-node", "1", "train.global_batch=64"], "global_batch"),
    (["--nodes", "1", "--gpus-per-node", "1", "--queue", "Team_A"], "not a DNS label"),
    (["--nodes", "1", "--gpus-per-node", "1", "--queue", "a-"], "not a DNS label"),
    # Checkpoints only at the end: a restarted JobSet would start again from step 0.
    (["--nodes", "1", "--gpus-per-node", "1", "train.checkpoint_every=0"], "checkpoint_every"),
    (["--nodes", "1", "--gpus-per-node", "1", "--name", "9lives"], "job name"),
    (["--nodes", "1", "--gpus-per-node", "1", "--storage", "lots"], "quantity"),
]


@pytest.mark.parametrize("args,words", BAD, ids=[w for _, w in BAD])
def test_bad_input_is_one_sentence_and_writes_nothing(
    tmp_path: Path, args: list[str], words: str
) -> None:
    out = tmp_path / "k8s"
    proc = run_hpcml("launch", "k8s", DIGITS, *args, "--out", str(out), cwd=tmp_path, check=False)
    assert proc.returncode == 2, proc.stderr
    assert words in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) <= 3  # one sentence, wrapped
    assert not out.exists()


def test_planner_refuses_a_config_that_does_not_fit(tmp_path: Path) -> None:
    """gpt-1.3b under plain DDP on one 24 GB L4: AdamW's states alone are ~21 GB."""
    out = tmp_path / "k8s"
    proc = run_hpcml(
        "launch", "k8s", str(ROOT / "examples" / "gpt_1p3b_fsdp_tp.yaml"), "parallel.tp=1",
        "parallel.strategy=ddp", "parallel.sequence_parallel=false", "--nodes", "1",
        "--gpus-per-node", "1", "--gpu", "l4", "--out", str(out), cwd=tmp_path, check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "does not fit 1 x l4" in proc.stderr and "planner predicts" in proc.stderr
    assert not out.exists()
    # The same model sharded over 16 H100s fits, and is written.
    run_hpcml(
        "launch", "k8s", str(ROOT / "examples" / "gpt_1p3b_fsdp_tp.yaml"), "--nodes", "2",
        "--gpus-per-node", "8", "--gpu", "h100-sxm", "--out", str(out), cwd=tmp_path,
    )  # fmt: skip
    assert (out / "02-jobset.yaml").exists()


def test_grace_period_from_a_measured_save(tmp_path: Path) -> None:
    """--measured-run: the save time a finished run measured (summary.json) sets the grace."""
    measured = tmp_path / "measured"
    measured.mkdir()
    (measured / "summary.json").write_text(
        json.dumps({"fault": {"checkpoints": {"count": 3, "total_s_median": 40.0}}})
    )
    docs, result = launch(
        tmp_path, "--nodes", "1", "--gpus-per-node", "1", "--measured-run", str(measured)
    )
    pod = docs["JobSet"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == grace_seconds(5.0, 40.0) == 95
    assert result["grace_from"] == f"save 40 s measured in {measured}"
