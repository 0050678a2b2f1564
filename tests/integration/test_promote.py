"""`hpcml promote` on a real MLflow SQLite store with real models scored on the digits' held-out
split: the first candidate is promoted on its gates, a better one replaces it (McNemar and the
bootstrap agree), a copy of the holder is refused with exit 3 and its version records why,
a failed gate refuses, and bad input is exit 2 with nothing registered. Then the whole deploy
with the same models: a real `hpcml serve --follow` under load takes a promoted version in
canary steps, and rolls back (traffic, alias, tags) one that breaches its latency SLO."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from tests import forked
from tests.conftest import ROOT, hpcml_env, run_hpcml
from tests.integration.mlflow_util import fresh_store

from hpcml.config import dump_config, load_config
from hpcml.data.sources import load_source
from hpcml.models.export import save_export
from hpcml.models.zoo import build_model
from hpcml.records import write_json_atomic
from hpcml.serve.codec.oip import encode_request_bytes

pytestmark = pytest.mark.timeout(300)

ARGS = {"input_shape": [3, 32, 32], "hidden": 32, "depth": 1, "num_classes": 10}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    return fresh_store(tmp_path_factory, "promote")


def trained(steps: int, seed: int = 0) -> torch.nn.Module:
    """An MLP trained `steps` Adam steps on the digits' training split (0: as initialized)."""
    splits = load_source(load_config(None).data)
    x, y = splits.train.tensors  # type: ignore[attr-defined]
    torch.manual_seed(seed)
    model = build_model("mlp", ARGS)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, len(y), (64,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    return model.eval()


def run_folder(
    run_dir: Path, model: torch.nn.Module, arch: str = "mlp", args: dict[str, Any] = ARGS
) -> Path:
    """A finished run folder as `hpcml train` leaves it: summary.json and export/."""
    cfg = load_config(None, ["model.name=mlp"])
    save_export(run_dir / "export", model, arch, args, (3, 32, 32), (10,),
                metadata={"data": {"source": "digits"}})  # fmt: skip
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    write_json_atomic(
        run_dir / "summary.json",
        {"config": cfg.model_dump(mode="json"), "world_size": 1, "status": "finished",
         "device": {"type": "cpu", "name": "cpu", "count": 1}, "precision": "fp32",
         "final": {"val_accuracy": 0.0}, "steps": 1},
    )  # fmt: skip
    return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("promote-runs")
    weak = trained(3)
    return {
        "weak": run_folder(root / "weak", weak),
        "weak-copy": run_folder(root / "weak-copy", weak),
        "good": run_folder(root / "good", trained(150)),
    }


def promote(store: str, *args: str) -> tuple[int, dict[str, Any], str]:
    proc = run_hpcml("promote", *args, "--json", env=hpcml_env(MLFLOW_TRACKING_URI=store),
                     check=False)  # fmt: skip
    out = json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else {}
    return proc.returncode, out, proc.stderr


def holder(store: str, name: str, alias: str = "production") -> int | None:
    from mlflow import MlflowClient

    return MlflowClient(store, store).get_registered_model(name).aliases.get(alias)


def version_tags(store: str, name: str, version: int) -> dict[str, str]:
    from mlflow import MlflowClient

    return MlflowClient(store, store).get_model_version(name, str(version)).tags


def test_first_promoted_then_better_then_refused(store: str, runs: dict[str, Path]) -> None:
    code, out, err = promote(store, str(runs["weak"]), "--model", "digits")
    assert code == 0, err
    assert out["incumbent_version"] is None and out["candidate_version"] == 1
    assert holder(store, "digits") == 1, out

    code, out, err = promote(store, str(runs["good"]), "--model", "digits")
    assert code == 0, err
    c = out["comparison"]
    assert c["samples"] == 359  # the digits' held-out split (20% of 1,797), by both models
    assert c["candidate"] > c["incumbent"] + 0.2
    assert c["p_value"] < 1e-6 and c["ci_low"] > 0
    assert holder(store, "digits") == 2
    tags = version_tags(store, "digits", 2)
    assert tags["hpcml.promote.decision"] == "promoted"
    assert tags["hpcml.promote.incumbent_version"] == "1"
    assert float(tags["hpcml.promote.p_value"]) == pytest.approx(c["p_value"])

    # The weak model again, now against the good one: refused, recorded, alias untouched.
    code, out, err = promote(store, str(runs["weak-copy"]), "--model", "digits")
    assert code == 3, err
    assert not out["promoted"] and out["comparison"]["gain"] < 0
    assert holder(store, "digits") == 2
    tags = version_tags(store, "digits", out["candidate_version"])
    assert tags["hpcml.promote.decision"] == "refused"
    assert "does not show a gain" in tags["hpcml.promote.reason"]


def test_failed_gates_refuse_even_the_first(store: str, runs: dict[str, Path]) -> None:
    """The size gate, and the latency gate: a real `hpcml serve` of the candidate driven by
    `hpcml loadtest`'s generator (2 s at 20/s); 1 us is below any real p99."""
    code, out, err = promote(
        store, str(runs["good"]), "--model", "gated", "--max-size-mb", "0.001",
        "--latency-budget-ms", "0.001", "--latency-duration", "2",
    )  # fmt: skip
    assert code == 3, err
    assert out["gates"]["size"]["passed"] is False and out["gates"]["smoke"]["passed"]
    lat = out["gates"]["latency"]
    assert lat["ok"] >= 30 and lat["errors"] == 0  # it served every request
    assert lat["p99_ms"] > 0.001 and not lat["passed"]
    assert out["reason"] == "gate(s) failed: size, latency"
    assert holder(store, "gated") is None


def test_bad_input_is_exit_2_and_registers_nothing(store: str, runs: dict[str, Path]) -> None:
    code, _, err = promote(store, str(runs["good"]), "--model", "bad", "--confidence", "1.5")
    assert code == 2 and "--confidence" in err and "Traceback" not in err
    code, _, err = promote(store, str(runs["good"].parent / "missing"), "--model", "bad")
    assert code == 2 and "not a finished hpcml run folder" in err
    from mlflow import MlflowClient

    assert not MlflowClient(store, store).search_registered_models("name = 'bad'")


def test_a_forward_pass_that_raises_fails_the_smoke_gate(tmp_path: Path) -> None:
    """An export that loads but cannot compute (its builder is fine, its input spec lies)
    fails the gate, and the latency gate does not serve it."""
    from hpcml.deploy.promote import Gates, check_gates

    torch.manual_seed(0)
    export = save_export(tmp_path / "export", build_model("mlp", ARGS), "mlp", ARGS, (3, 16, 16),
                         (10,))  # fmt: skip
    out = check_gates(export, Gates(latency_budget_ms=100.0))
    assert out["smoke"]["passed"] is False and "forward pass failed" in out["smoke"]["detail"]
    assert "latency" not in out


def test_a_rollback_leaves_an_alias_someone_moved_since(store: str, runs: dict[str, Path]) -> None:
    from hpcml.track.registry import register_run, roll_back_alias

    for run in ("weak", "good"):
        register_run(runs[run], "moved", tracking_uri=store)
    from mlflow import MlflowClient

    MlflowClient(store, store).set_registered_model_alias("moved", "production", "2")
    assert not roll_back_alias("moved", "production", candidate=1, previous=2, tracking_uri=store)
    assert holder(store, "moved") == 2
    assert roll_back_alias("moved", "production", candidate=2, previous=1, tracking_uri=store)
    assert holder(store, "moved") == 1


# -- the deploy: promote -> serve --follow -> canary -> rollback -----------------------------

SLOW_S = 1.5
"""The slow candidate's forward pass sleeps this long, so each answer of its takes at least
this long on any machine: its p99 breaches the SLO below however fast the machine is."""
SERVE = {
    "drift": {"enabled": False},
    "defaults": {
        "isolation": "thread",
        "threads": 1,
        # 750 ms: half the slow model's sleep, and some hundred times the milliseconds the
        # MLP's answers take on loopback at this load, so a busy machine does not breach it.
        "canary": {"steps": [0.5, 1.0], "step_s": 1.0, "min_requests": 5, "max_p99_ms": 750},
    },
}
RATE = 20.0
"""Requests per second, sent open loop (a slow answer does not hold the next request back)."""


def slow_run(run_dir: Path, good: Path) -> Path:
    """The good model's weights in a model that sleeps before its forward pass: as accurate,
    so `promote` accepts it over the weak one, and slow by construction."""
    from safetensors.torch import load_file
    from tests.integration.slow_model import NAME, build

    args = {**ARGS, "sleep_s": SLOW_S}
    model = build(**args)
    model.load_state_dict(load_file(str(good / "export" / "model.safetensors")))
    return run_folder(run_dir, model.eval(), NAME, args)


@contextlib.contextmanager
def follow_server(store: str, work: Path) -> Iterator[str]:
    """`hpcml serve models:/ci-digits@production --follow` with SERVE, forked from the
    pre-imported server as `run_hpcml` forks (HPCML_TEST_FORK=0: a new interpreter); its
    CPU counts in the test's record either way."""
    from hpcml.serve.loadtest import wait_ready
    from hpcml.serve.protocol.app import bind_socket

    (work / "serve.yaml").write_text(yaml.safe_dump(SERVE))
    sock = bind_socket("127.0.0.1", 0)
    port = int(sock.getsockname()[1])
    sock.close()
    argv = ["serve", f"models:/{DEPLOYED}@production", "--follow", "--poll-s", "0.25",
            "--config", str(work / "serve.yaml"), "--trust-code", "--port", str(port)]  # fmt: skip
    env = hpcml_env(MLFLOW_TRACKING_URI=store)
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env['PYTHONPATH']}"  # the slow model's module
    out, err, usage = (str(work / n) for n in ("serve.out", "serve.err", "serve.cpu"))
    if forked.ENABLED:
        proc: Any = forked.server_context().Process(
            target=forked._command, args=(argv, str(work), env, (None, out, err), usage)
        )
        proc.start()
    else:
        with open(out, "w") as stdout, open(err, "w") as stderr:
            proc = subprocess.Popen([sys.executable, "-m", "hpcml", *argv], cwd=work, env=env,
                                    stdout=stdout, stderr=stderr)  # fmt: skip
    try:
        wait_ready(f"http://127.0.0.1:{port}", timeout_s=120)
        yield f"http://127.0.0.1:{port}"
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        if forked.ENABLED:
            proc.join(60)
            if proc.exitcode is None:
                forked.kill_tree(proc)
                proc.join()
            forked.add_cpu(usage)
        else:
            proc.wait(60)


DEPLOYED = "ci-digits"


@dataclasses.dataclass
class Answer:
    sent: float
    done: float
    status: int
    version: str


def test_push_to_serve_better_served_worse_refused_slow_rolled_back(
    store: str, runs: dict[str, Path], tmp_path: Path
) -> None:
    """The CI's sequence against one registry while `serve --follow` answers RATE requests/s:
    the weak model is promoted (first version); a candidate as accurate as the good model but
    slow by construction is promoted over it, takes half the traffic and is rolled back on its
    p99 (traffic, alias and tags); the good model is promoted, passes both canary steps and
    serves alone; a worse one is refused and never served. No request fails throughout."""
    from hpcml.deploy.promote import promote_run

    slow = slow_run(tmp_path / "slow", runs["good"])

    def promote_in(run: Path) -> bool:
        outcome = promote_run(run, DEPLOYED, tracking_uri=store, trust_code=True)
        return outcome.promoted

    def canary_tags(version: int) -> dict[str, str]:
        tags = version_tags(store, DEPLOYED, version)
        return {k.removeprefix("hpcml.canary."): v for k, v in tags.items()
                if k.startswith("hpcml.canary.")}  # fmt: skip

    assert promote_in(runs["weak"])  # version 1: nothing held production
    body = encode_request_bytes(np.zeros((1, 3, 32, 32), dtype=np.float32))

    async def drive(url: str) -> tuple[list[Answer], dict[str, float], list[str]]:
        answers: list[Answer] = []
        seen: dict[str, float] = {}
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:

            async def one() -> None:
                t0 = time.monotonic()
                r = await c.post(f"/v2/models/{DEPLOYED}/infer", content=body,
                                 headers={"content-type": "application/json"})  # fmt: skip
                version = r.json().get("model_version", "") if r.status_code == 200 else r.text
                answers.append(Answer(t0, time.monotonic(), r.status_code, version))

            async def load(stop: asyncio.Event) -> None:
                pending: set[asyncio.Task[None]] = set()
                while not stop.is_set():
                    task = asyncio.create_task(one())
                    pending.add(task)
                    task.add_done_callback(pending.discard)
                    await asyncio.sleep(1 / RATE)
                await asyncio.gather(*pending)

            async def until(check: Any, what: str) -> None:
                deadline = time.monotonic() + 120
                while not await asyncio.to_thread(check):
                    assert time.monotonic() < deadline, what
                    await asyncio.sleep(0.1)
                seen[what] = time.monotonic()

            def served(version: str) -> int:
                return sum(a.version == version for a in answers)

            stop = asyncio.Event()
            sender = asyncio.create_task(load(stop))
            try:
                await steps(until, served)
            finally:
                stop.set()
                await sender
            versions = (await c.get(f"/v2/models/{DEPLOYED}")).json()["versions"]
        return answers, seen, versions

    async def steps(until: Any, served: Any) -> None:
        """The CI's pushes, each awaited until the server has acted on it."""
        await until(lambda: served("1") >= 10, "version 1 answered")
        assert await asyncio.to_thread(promote_in, slow)  # version 2, over version 1
        await until(lambda: "decision" in canary_tags(2), "version 2 judged")
        assert holder(store, DEPLOYED) == 1  # the alias is back
        assert await asyncio.to_thread(promote_in, runs["good"])  # version 3
        await until(lambda: "decision" in canary_tags(3), "version 3 judged")
        assert not await asyncio.to_thread(promote_in, runs["weak-copy"])  # version 4
        n = served("3")
        await until(lambda: served("3") >= n + 10, "version 3 answered on")

    with follow_server(store, tmp_path) as url:
        answers, seen, versions = asyncio.run(drive(url))
    log = (tmp_path / "serve.err").read_text()
    print(f"\n{len(answers)} requests; server log:\n{log[-1500:]}")
    assert {a.status for a in answers} == {200}, [a for a in answers if a.status != 200][:3]
    by = {v: [a for a in answers if a.version == v] for v in ("1", "2", "3")}
    assert {a.version for a in answers} == {"1", "2", "3"}  # version 4 never
    # Version 2 took traffic, every answer of its was slow, and none after the rollback.
    assert len(by["2"]) >= 5 and min(a.done - a.sent for a in by["2"]) >= SLOW_S
    assert all(a.sent < seen["version 2 judged"] for a in by["2"])
    tags = canary_tags(2)
    assert tags["decision"] == "rolled_back" and tags["alias_moved_back"] == "True"
    assert "p99 latency" in tags["reason"] and float(tags["p99_ms"]) >= SLOW_S * 1000
    assert tags["previous"] == "1" and tags["share"] == "0.5"
    # Version 3 went in steps: version 1 still answered after version 3's first answer.
    first_3 = min(a.done for a in by["3"])
    assert any(a.sent > first_3 for a in by["1"])
    assert canary_tags(3)["decision"] == "completed" and canary_tags(3)["step"] == "2"
    assert all(a.version == "3" for a in answers if a.sent > seen["version 3 judged"])
    assert holder(store, DEPLOYED) == 3 and versions == ["3"]
    assert version_tags(store, DEPLOYED, 4)["hpcml.promote.decision"] == "refused"
    assert not canary_tags(4)
