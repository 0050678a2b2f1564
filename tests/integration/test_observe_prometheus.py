"""A real Prometheus (Debian's `prometheus`) scrapes a real 2-process training run and a real
`hpcml serve`, both found only through their file_sd target files. Its HTTP query API returns
the run's series with the job/run/rank/host labels and values the run's own records agree with.
Every panel query of the shipped Grafana dashboards returns data: the GPU panels from an
exporter reading a fake NVML module, the others from the run (gpt-tiny on byte tokens with a
peak FLOP rate given, so tokens/s and MFU have data) and the server (with a shadow version of
the same weights, so the shadow panel has data at 0 disagreements; the error-ratio and
straggler panels show 0 when nothing failed or was slow, not "No data"). Every template
variable's query lists what it should (job, run, model). A preemption (SIGTERM, exit 75)
removes both ranks' targets and Prometheus drops them (HpcmlTrainingDown stays silent); the
server's target goes when it stops."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from fault_util import env, finish, records, start_train, wait_for, write_config
from tests.conftest import run_hpcml, system_binary
from tests.fake_nvml import FakeNvml

from hpcml.data.sources.tokens import prepare_pystdlib
from hpcml.errors import REQUEUE_EXIT_CODE
from hpcml.models.export import save_export
from hpcml.models.zoo import build_model
from hpcml.observe.train_metrics import TrainExporter

pytestmark = pytest.mark.slow
DASHBOARDS = Path(__file__).resolve().parents[2] / "src" / "hpcml" / "observe" / "dashboards"
# Panels the CPU run cannot feed: they are checked against an exporter reading a fake NVML
# module instead (job "itest-gpu"), as no GPU was lent to this work.
NO_DATA_HERE = {"GPU utilization", "GPU memory used", "GPU temperature", "GPU power"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def query(url: str, promql: str) -> list[dict[str, Any]]:
    q = urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(f"{url}/api/v1/query?{q}", timeout=10) as resp:
        body = json.load(resp)
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def start_prometheus(tmp: Path, targets: Path) -> tuple[subprocess.Popen[bytes], str]:
    """Prometheus on the configuration `hpcml observe up` writes (its rules included)."""
    port = free_port()
    stack = tmp / "stack"
    run_hpcml("observe", "up", "--targets", str(targets), "--out", str(stack), "--scrape-s", "1",
              "--port", str(port))
    proc = subprocess.Popen(
        [
            system_binary("prometheus", installer=".ci/install_prometheus.sh"),
            f"--config.file={stack / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(tmp / "prometheus.log").open("wb"),
    )
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    wait_for("prometheus ready", ready, timeout=60, every=0.2)
    return proc, url


def start_server(tmp: Path, targets: Path) -> tuple[subprocess.Popen[str], str]:
    torch.manual_seed(0)
    args = {"hidden": 16, "depth": 1}
    export = save_export(tmp / "export", build_model("mlp", args), "mlp", args, (3, 32, 32), (10,))
    # Version 2 (the same weights) as a shadow of every request to version 1: its panel has data.
    config = tmp / "serve.yaml"
    shadow = {
        "versions": {"2": {"path": str(export)}},
        "traffic": {"1": 1.0},
        "shadow": {"version": "2", "fraction": 1.0},
    }
    config.write_text(json.dumps({"models": {"digits": shadow}}))
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpcml", "serve", str(export), "--name", "digits", "--port",
         str(port), "--prometheus-targets", str(targets), "--config", str(config)],
        env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return httpx.get(f"{url}/v2/health/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for("hpcml serve ready", ready, timeout=120, every=0.2, proc=proc)
    return proc, url


def panel_queries(name: str) -> list[tuple[str, str]]:
    board = json.loads((DASHBOARDS / name).read_text())
    return [(p["title"], t["expr"]) for p in board["panels"] for t in p["targets"]]


def concrete(expr: str) -> str:
    """A dashboard query as Grafana would send it for this test's job, run and model."""
    for var, value in (("$job", "itest"), ("$run", "run"), ("$model", "digits"),
                       ("$__rate_interval", "15s")):
        expr = expr.replace(var, value)
    return expr


def query_variables(name: str) -> dict[str, str]:
    """A dashboard's template variables that Grafana fills from a query, by name."""
    board = json.loads((DASHBOARDS / name).read_text())
    return {v["name"]: v["definition"] for v in board["templating"]["list"] if v["type"] == "query"}


def label_values(url: str, definition: str) -> set[str]:
    """Grafana's `label_values(SELECTOR, LABEL)` template query, through Prometheus' series API."""
    selector, label = definition.removeprefix("label_values(").removesuffix(")").rsplit(",", 1)
    q = urllib.parse.urlencode({"match[]": concrete(selector.strip())})
    with urllib.request.urlopen(f"{url}/api/v1/series?{q}", timeout=10) as resp:
        series = json.load(resp)["data"]
    return {s[label.strip()] for s in series if label.strip() in s}


def assert_panels_have_data(url: str, name: str, only: set[str] | None = None,
                            job: str = "itest") -> None:  # fmt: skip
    """Every panel (or those in `only`) has data within 30 s (rate() needs two scrapes of a new
    series)."""

    def empty() -> list[str]:
        return [
            title
            for title, expr in panel_queries(name)
            if (title in only if only else title not in NO_DATA_HERE)
            and not query(url, concrete(expr).replace('job="itest"', f'job="{job}"'))
        ]

    left: list[str] = []

    def none_empty() -> bool:
        left[:] = empty()
        return not left

    try:
        wait_for(f"every {name} panel with data", none_empty, timeout=30, every=1.0)
    except AssertionError:
        raise AssertionError(f"{name}: panels without data: {left}") from None


def by_rank(result: list[dict[str, Any]]) -> dict[str, float]:
    return {r["metric"]["rank"]: float(r["value"][1]) for r in result}


def test_prometheus_scrapes_training_and_serving_through_file_sd(tmp_path: Path) -> None:
    # One folder of target files for the run and the server, as a cluster would share.
    run, targets = tmp_path / "run", tmp_path / "targets"
    prom, url = start_prometheus(tmp_path, targets)
    # A rank whose GPU readings come from a fake NVML module, for the GPU panels.
    gpu_rank = TrainExporter(0, "127.0.0.1", tmp_path / "gpu" / "run", 0, 1, job="itest-gpu",
                             targets_dir=targets, gpu_index=0, nvml=FakeNvml(), gpu_uuid="GPU-fake")
    gpu_rank.update([{"step": 1, "loss": 1.0, "step_time_s": 0.1, "data_wait_s": 0.0}], {})
    with urllib.request.urlopen(f"{url}/api/v1/rules", timeout=10) as resp:
        loaded = [r["name"] for g in json.load(resp)["data"]["groups"] for r in g["rules"]]
    assert len(loaded) == 14 and "HpcmlTrainingDown" in loaded
    server, server_url = start_server(tmp_path, targets)
    try:
        # A token model (gpt-tiny on standard-library bytes), so the tokens/s panel has data.
        corpus = tmp_path / "corpus"
        prepare_pystdlib(corpus, val_fraction=0.2, max_bytes=100_000)
        config = write_config(
            tmp_path / "c.yaml",
            model={"name": "gpt-tiny", "args": {}},
            data={"source": "tokens", "path": str(corpus), "seq_len": 32, "batch_size": 4,
                  "eval_windows": 2, "limit_train": None},
            # A peak FLOP rate given by hand (what a CPU needs for MFU): the MFU panel has data.
            train={"max_steps": 100_000, "checkpoint_every": 0, "log_every": 2,
                   "peak_flops": 1e11},
            observe={"metrics_port": 0, "metrics_address": "127.0.0.1", "job": "itest",
                     "targets_dir": str(targets)},
        )
        proc = start_train(config, run, "--nproc", "2")
        try:
            steps = wait_for(
                "both ranks scraped past step 4",
                lambda: (s := by_rank(query(url, 'hpcml_train_step{job="itest"}')))
                and len(s) == 2
                and min(s.values()) >= 4
                and s,
                timeout=180,
                every=0.5,
                proc=proc,
            )
            assert sorted(steps) == ["0", "1"]
            series = query(url, 'hpcml_train_step{job="itest"}')
            for s in series:
                labels = s["metric"]
                assert labels["run"] == "run" and labels["host"] == socket.gethostname(), labels
            logged = {r["step"]: r["loss"] for r in records(run)}
            loss = query(url, 'hpcml_train_loss{job="itest", rank="0"}')
            step0 = query(url, 'hpcml_train_step{job="itest", rank="0"}')
            # The scraped loss is one the run logged for a step it had flushed (not checked at
            # the same instant: the run moves on between the two queries).
            assert float(loss[0]["value"][1]) in set(logged.values())
            assert int(float(step0[0]["value"][1])) in logged
            counts = by_rank(query(url, 'hpcml_train_step_seconds_count{job="itest"}'))
            assert sorted(counts) == ["0", "1"] and min(counts.values()) >= 4
            skipped = by_rank(
                query(url, 'hpcml_train_fault_events_total{job="itest",event="skipped_steps"}')
            )
            assert skipped == {"0": 0.0, "1": 0.0}
            # Series the process collector exports carry the rank from the target file; a
            # Python process that imported torch holds far more than 50 MB.
            rss = by_rank(query(url, 'process_resident_memory_bytes{role="train",job="itest"}'))
            assert sorted(rss) == ["0", "1"] and min(rss.values()) > 50e6
            # rate() needs two scrapes of a series inside its window.
            wait_for(
                "two scrapes of both ranks inside 15 s",
                lambda: len(query(url, 'rate(process_cpu_seconds_total{job="itest"}[15s])')) == 2,
                timeout=60,
                every=0.5,
            )
            assert_panels_have_data(url, "training.json")
            assert_panels_have_data(url, "training.json", only=NO_DATA_HERE, job="itest-gpu")
            # The dashboard's template variables list this run and the GPU rank's.
            variables = query_variables("training.json")
            assert sorted(variables) == ["job", "run"]
            assert {"itest", "itest-gpu"} <= label_values(url, variables["job"])
            assert label_values(url, variables["run"]) == {"run"}
            gpu_rank.close()

            # The server, found through its own target file: 20 requests answered, then seen.
            x = torch.randn(2 * 3 * 32 * 32, generator=torch.Generator().manual_seed(0)).tolist()
            inputs = [{"name": "input", "datatype": "FP32", "shape": [2, 3, 32, 32], "data": x}]
            for _ in range(20):
                r = httpx.post(f"{server_url}/v2/models/digits/infer", json={"inputs": inputs}, timeout=30)
                assert r.status_code == 200, r.text
            wait_for(
                "the 20 requests scraped",
                lambda: [
                    r for r in query(url, 'sum(hpcml_requests_total{model="digits",code="200"})')
                    if float(r["value"][1]) == 20
                ],
                timeout=60,
                every=0.5,
            )
            assert_panels_have_data(url, "serving.json")
            # The serving dashboard's one query variable lists the served model.
            variables = query_variables("serving.json")
            assert list(variables) == ["model"]
            assert label_values(url, variables["model"]) == {"digits"}
        finally:
            # A preemption (SLURM's SIGTERM): the run saves, exits 75, and its ranks' targets go
            # with them, so HpcmlTrainingDown does not fire on an orderly stop.
            proc.send_signal(signal.SIGTERM)
            out, _ = finish(proc, 120)
        assert proc.returncode == REQUEUE_EXIT_CODE, out
        assert not [p.name for p in targets.iterdir() if p.name.startswith("itest-")]
        wait_for(
            "Prometheus dropping both ranks' targets",
            lambda: not query(url, 'up{job="itest",role="train"}'),
            timeout=60,
            every=0.5,
        )
        left = sorted(p.name for p in targets.iterdir())
        assert len(left) == 1 and left[0].startswith("serve-")
        server.send_signal(signal.SIGTERM)
        finish(server, 60)
        # A clean stop removes the server's target.
        assert list(targets.iterdir()) == []
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
        gpu_rank.close()
        prom.terminate()
        prom.wait(30)
