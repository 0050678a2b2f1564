"""`hpcml promote RUN --model NAME`: evaluate a finished run's export and the version behind the
alias on the same held-out samples, decide with a paired test (`hpcml.deploy.stats`), check the
candidate's gates (a smoke inference, its size, its p99 latency under `hpcml loadtest` against a
real `hpcml serve`), register it, and move the alias only if everything passed. The decision
and its evidence are tags of the new version (`hpcml.promote.*`), so the registry says why a
version was or was not promoted.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from hpcml.errors import ConfigError
from hpcml.track.audit import Attribution
from hpcml.track.moves import move_alias
from hpcml.track.registry import RegistryError, check_alias, check_name

TAG = "hpcml.promote"
METRICS = ("accuracy", "loss")


@dataclass(frozen=True)
class Gates:
    max_size_mb: float | None = None
    latency_budget_ms: float | None = None
    """p99 of `hpcml loadtest` at `latency_rate` against the candidate served alone."""
    latency_rate: float = 20.0
    latency_duration_s: float = 5.0


@dataclass
class Outcome:
    promoted: bool
    name: str
    alias: str
    candidate_version: int | None
    incumbent_version: int | None
    comparison: dict[str, Any] | None
    gates: dict[str, Any]
    reason: str
    tags: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def check_inputs(run_dir: Path, name: str, alias: str, confidence: float, min_gain: float,
                 metric: str) -> dict[str, Any]:  # fmt: skip
    """Everything a user can get wrong, refused before any evaluation; the run's summary."""
    from hpcml.records import SUMMARY, read_summary
    from hpcml.track.mlflow import EXPORT_DIR

    check_name(name)
    check_alias(alias)
    if metric not in METRICS:
        raise ConfigError(f"--metric {metric!r} is not one of {', '.join(METRICS)}.")
    if not 0.5 <= confidence < 1.0:
        raise ConfigError(f"--confidence {confidence:g} must lie in [0.5, 1), e.g. 0.95.")
    if not math.isfinite(min_gain) or min_gain < 0:
        raise ConfigError(f"--min-gain {min_gain:g} must be a finite number >= 0.")
    if not (run_dir / SUMMARY).is_file() or not (run_dir / EXPORT_DIR / "model.json").is_file():
        raise RegistryError(
            f"{run_dir} is not a finished hpcml run folder (no {SUMMARY} or {EXPORT_DIR}/); "
            "promote the folder `hpcml train --run-dir` wrote."
        )
    summary = read_summary(run_dir)
    if summary.get("status", "finished") != "finished":
        raise RegistryError(
            f"{run_dir} ended with status {summary.get('status')!r}; resume it to the end first."
        )
    return summary


def held_out(summary: dict[str, Any], eval_config: Path | None) -> Any:
    """The validation split of `--eval CONFIG`'s data section, else of the run's own config."""
    from hpcml.config import DataConfig, load_config
    from hpcml.data.sources import load_source

    if eval_config is not None:
        data = load_config(eval_config).data
    else:
        data = DataConfig.model_validate((summary.get("config") or {}).get("data") or {})
    return load_source(data)


def scores(
    export: Path, splits: Any, batch: int = 256, trust_code: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Per-sample correctness (a token model: the share of its positions) and loss."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    from hpcml.errors import ModelError
    from hpcml.models.export import load_export

    model, _ = load_export(export, trust_code=trust_code)
    correct, losses = [], []
    with torch.no_grad():
        for x, y in DataLoader(splits.val, batch_size=batch):
            if splits.device_normalize is not None:
                x = splits.device_normalize(x)
            try:
                logits = model(x)
                loss = F.cross_entropy(
                    logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none"
                ).reshape(y.shape)
            except (RuntimeError, ValueError, IndexError) as exc:
                raise ModelError(
                    f"the model in {export} cannot score the held-out set "
                    f"({str(exc).splitlines()[0][:120]}); pass --eval with that model's data."
                ) from None
            hits = (logits.argmax(dim=-1) == y).double()
            dims = tuple(range(1, y.dim()))
            correct.append((hits.mean(dim=dims) if dims else hits).numpy())
            losses.append((loss.double().mean(dim=dims) if dims else loss.double()).numpy())
    return np.concatenate(correct), np.concatenate(losses)


def smoke(export: Path, trust_code: bool = False) -> tuple[bool, str]:
    """One forward of an example batch: it runs and gives finite outputs. A forward pass that
    raises fails the gate (an export that cannot be loaded is bad input, raised)."""
    import torch

    from hpcml.models.export import example_input, load_export

    model, meta = load_export(export, trust_code=trust_code)
    torch.manual_seed(0)
    try:
        with torch.no_grad():
            out = model(example_input(meta, batch=2))
    except (RuntimeError, ValueError, IndexError, TypeError) as exc:
        why = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        return False, f"the forward pass failed ({why})"
    ok = bool(torch.isfinite(out.float()).all())
    return ok, f"output {tuple(out.shape)}" + ("" if ok else " holds NaN or Inf")


def size_mb(export: Path) -> float:
    return sum(p.stat().st_size for p in export.rglob("*") if p.is_file()) / 1e6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def latency_p99_ms(
    export: Path, gates: Gates, trust_code: bool = False
) -> tuple[float | None, dict[str, Any]]:
    """Serve the candidate alone with `hpcml serve` on loopback and drive it with the load
    generator of `hpcml loadtest`; p99 of successful requests (None when none succeeded)."""
    from hpcml.serve.loadtest import loadtest, wait_ready

    port = _free_port()
    cmd = [sys.executable, "-m", "hpcml", "serve", str(export), "--name", "candidate",
           "--port", str(port)] + (["--trust-code"] if trust_code else [])  # fmt: skip
    server = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, timeout_s=120)
        result = loadtest(
            base_url=url, model="candidate", rate=gates.latency_rate,
            duration_s=gates.latency_duration_s, seed=0,
        )  # fmt: skip
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    p99 = result.latency_ms.get("p99")
    return p99, {"ok": result.ok, "errors": sum(result.errors.values()), "valid": result.valid}


def check_gates(export: Path, gates: Gates, trust_code: bool = False) -> dict[str, Any]:
    """Each gate's result; the latency gate runs only when the smoke inference passed."""
    out: dict[str, Any] = {}
    ok, detail = smoke(export, trust_code)
    out["smoke"] = {"passed": ok, "detail": detail}
    mb = size_mb(export)
    out["size"] = {
        "passed": gates.max_size_mb is None or mb <= gates.max_size_mb,
        "mb": round(mb, 3),
        "budget_mb": gates.max_size_mb,
    }
    if gates.latency_budget_ms is not None and ok:
        p99, load = latency_p99_ms(export, gates, trust_code)
        passed = p99 is not None and p99 <= gates.latency_budget_ms and load["errors"] == 0
        out["latency"] = {"passed": passed, "p99_ms": p99, "budget_ms": gates.latency_budget_ms,
                          **load}  # fmt: skip
    return out


def _tags(outcome: Outcome) -> dict[str, str]:
    c = outcome.comparison or {}
    tags = {
        f"{TAG}.decision": "promoted" if outcome.promoted else "refused",
        f"{TAG}.alias": outcome.alias,
        f"{TAG}.reason": outcome.reason[:4000],
        f"{TAG}.incumbent_version": str(outcome.incumbent_version or ""),
        f"{TAG}.gates": json.dumps(outcome.gates, sort_keys=True)[:4000],
    }
    for key in ("metric", "samples", "gain", "ci_low", "ci_high", "confidence", "p_value"):
        if c.get(key) is not None:
            tags[f"{TAG}.{key}"] = str(c[key])
    return tags


def _incumbent(name: str, alias: str, tracking_uri: str | None) -> tuple[int | None, Path | None]:
    """The version behind `alias` and its export folder, or (None, None) without one."""
    from mlflow.exceptions import MlflowException

    from hpcml.track.resolve import resolve_model
    from hpcml.track.store import open_client

    client, uri = open_client(tracking_uri)
    try:
        holder = client.get_registered_model(name).aliases.get(alias)
    except MlflowException:
        return None, None  # no such model yet: the first version is promoted on its gates
    if holder is None:
        return None, None
    resolved = resolve_model(f"models:/{name}@{alias}", tracking_uri=uri)
    return int(holder), resolved.path


def promote_run(
    run_dir: Path,
    name: str,
    alias: str = "production",
    metric: str = "accuracy",
    min_gain: float = 0.0,
    confidence: float = 0.95,
    eval_config: Path | None = None,
    gates: Gates | None = None,
    tracking_uri: str | None = None,
    trust_code: bool = False,
    by: Attribution | None = None,
) -> Outcome:
    """Compare, check, register, and move `alias` only when the candidate is better and passes
    every gate. The new version carries the decision and its evidence as tags either way.
    `trust_code` (`--trust-code`): the exports may name their architecture by import path.
    `by`: who promotes and why (default this OS user); the decision's reason follows theirs."""
    from hpcml.deploy.stats import compare
    from hpcml.track.mlflow import EXPORT_DIR
    from hpcml.track.registry import register_run
    from hpcml.track.store import open_client

    summary = check_inputs(run_dir, name, alias, confidence, min_gain, metric)
    splits = held_out(summary, eval_config)
    export = run_dir / EXPORT_DIR
    gate_results = check_gates(export, gates or Gates(), trust_code)
    inc_version, inc_export = _incumbent(name, alias, tracking_uri)
    comparison = None
    if inc_export is not None and gate_results["smoke"]["passed"]:
        pick = 0 if metric == "accuracy" else 1
        cand_scores = scores(export, splits, trust_code=trust_code)[pick]
        inc_scores = scores(inc_export, splits, trust_code=trust_code)[pick]
        comparison = compare(metric, cand_scores, inc_scores, confidence, min_gain).to_dict()
    failed = [k for k, g in gate_results.items() if not g["passed"]]
    if failed:
        reason = f"gate(s) failed: {', '.join(failed)}"
    elif comparison is None:
        reason = f"no version held {alias!r}; the candidate passed its gates"
    else:
        reason = comparison["reason"]
    promoted = not failed and (comparison is None or comparison["better"])
    info = register_run(run_dir, name, tracking_uri)
    version = int(info["version"])
    outcome = Outcome(promoted, name, alias, version, inc_version, comparison, gate_results, reason)
    outcome.tags = _tags(outcome)
    client, _ = open_client(tracking_uri)
    for key, value in outcome.tags.items():
        client.set_model_version_tag(name, str(version), key, value)
    if promoted:
        base = by or Attribution.local()
        why = f"{base.why}; {reason}" if base.why else reason
        move_alias(client, name, alias, version, replace(base, why=why), "promote",
                   previous=None if inc_version is None else str(inc_version))  # fmt: skip
    return outcome
