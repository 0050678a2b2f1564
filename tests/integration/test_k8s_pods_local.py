"""The JobSet's pods, run here as processes: each "pod" is the container's command and args with
the environment its manifest gives (the node rank from the Indexed Job's completion index, as
the downward API would), and the two rendezvous and train one 2-process DDP run together.

What a cluster provides and this machine cannot is stood in for, and only that: the headless
Service's DNS name of pod 0 resolves to 127.0.0.1, the ConfigMap and the claim are local
folders at the mount paths' places (both pods share the claim's folder, as ReadWriteMany), and
pod 1's metrics port moves up by the workers of pod 0 because the two pods share this
machine's network instead of each having its own.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from tests.conftest import ROOT, hpcml_env, run_hpcml, step_losses, summary

from hpcml.launch.k8s import COMPLETION_INDEX, CONFIG_DIR, RUN_ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def pod_process(container: dict[str, Any], index: int, local: dict[str, Path], master: str,
                metrics_shift: int) -> tuple[list[str], dict[str, str]]:  # fmt: skip
    """argv and environment of pod `index`: what the kubelet would start."""
    env = {}
    for var in container["env"]:
        if "value" in var:
            env[var["name"]] = var["value"]
        else:  # the downward API: only the completion index is used
            assert var["valueFrom"]["fieldRef"]["fieldPath"] == COMPLETION_INDEX
            env[var["name"]] = str(index)
    assert env["PET_MASTER_ADDR"] == master
    env["PET_MASTER_ADDR"] = "127.0.0.1"  # the cluster DNS name of pod 0

    def mount(arg: str) -> str:
        for path, folder in local.items():
            arg = arg.replace(path, str(folder))
        if arg.startswith("observe.metrics_port="):
            arg = f"observe.metrics_port={int(arg.split('=')[1]) + metrics_shift}"
        return arg

    assert container["command"][0] == "python"
    argv = [sys.executable, *container["command"][1:], *(mount(a) for a in container["args"])]
    return argv, hpcml_env(**env)


def test_two_pods_rendezvous_and_train(tmp_path: Path, tiny_args: list[str]) -> None:
    rdzv, metrics = free_ports(2)
    out = tmp_path / "k8s"
    run_hpcml(
        "launch", "k8s", str(ROOT / "examples" / "digits_cnn.yaml"), *tiny_args,
        "train.max_steps=4", "train.checkpoint_every=4", "data.batch_size=8",
        "--nodes", "2", "--gpus-per-node", "0", "--name", "digits", "--port", str(rdzv),
        "--metrics-port", str(metrics), "--out", str(out), cwd=tmp_path,
    )  # fmt: skip
    jobset = yaml.safe_load((out / "02-jobset.yaml").read_text())
    config = yaml.safe_load((out / "00-configmap.yaml").read_text())
    etc, claim = tmp_path / "etc-hpcml", tmp_path / "claim"
    etc.mkdir()
    claim.mkdir()
    for key, text in config["data"].items():  # the ConfigMap, mounted
        (etc / key).write_text(text)
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    (container,) = job["template"]["spec"]["containers"]
    procs = []
    for index in range(job["parallelism"]):
        argv, env = pod_process(
            container, index, {CONFIG_DIR: etc, RUN_ROOT: claim}, "digits-node-0-0.digits", index
        )
        procs.append(
            subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        )  # fmt: skip
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    for p, text in zip(procs, outputs, strict=True):
        assert p.returncode == 0, text[-3000:]
    run_dir = claim / "digits"
    s = summary(run_dir)
    assert s["world_size"] == 2  # one process in each pod, one group
    assert sorted(step_losses(run_dir)) == [1, 2, 3, 4]
    assert os.listdir(run_dir / "checkpoints")  # saved on the shared claim
