"""Models, their versions and the traffic between them: canary split, shadow, promote, rollback.

A `TrafficPolicy` (version weights + optional shadow) is immutable; changing traffic swaps the
model's policy reference in one step on the event loop, so the next request sees the new policy
and requests already routed finish on the version they started on. Every loaded version keeps
its batcher running, which is why a rollback fails no request. Shadow copies run on the
candidate's own batcher after the answer is decided and never change it; their latency and
disagreement go to the metrics.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from hpcml.models.signing import verify_export
from hpcml.serve.config import ModelServeConfig, ServeConfig
from hpcml.serve.metrics import ServeMetrics
from hpcml.serve.runtime.backends import Backend, make_backend
from hpcml.serve.runtime.batcher import DynamicBatcher, InferResult
from hpcml.serve.runtime.repository import ModelSource
from hpcml.serve.traffic.drift import DriftMonitor
from hpcml.serve.traffic.versions import (
    ModelVersion,
    NotFound,
    PolicyError,
    ServedModel,
    ShadowStats,
    TrafficPolicy,
    check_policy,
)
from hpcml.track.audit import AuditLog


def worker_restarts_counter(metrics: ServeMetrics) -> Any:
    """`hpcml_worker_restarts_total{model,version}`: inference processes restarted after dying.

    Taken from `ServeMetrics` where it defines one, else made here in its registry (once)."""
    counter = getattr(metrics, "worker_restarts", None)
    if counter is None:
        from prometheus_client import Counter

        counter = Counter(
            "hpcml_worker_restarts",
            "Inference processes restarted after they died.",
            ["model", "version"],
            registry=metrics.registry,
        )
        metrics.worker_restarts = counter  # type: ignore[attr-defined]
    return counter


class Router:
    def __init__(
        self,
        config: ServeConfig,
        metrics: ServeMetrics,
        seed: int | None = None,
        trust_code: bool = False,
    ) -> None:
        self.config = config
        self.trust_code = trust_code
        """Whether model.json may name an import path (`--trust-code`); never from a file."""
        self.metrics = metrics
        self.models: dict[str, ServedModel] = {}
        self._rng = random.Random(seed)
        self._shadow_tasks: set[asyncio.Task[None]] = set()
        self._loaded: set[int] = set()
        self._started = False
        self.worker_restarts = worker_restarts_counter(metrics)
        self.background: list[Callable[[], Coroutine[Any, Any, None]]] = []
        """Coroutines run while the server runs (an alias follower); cancelled on close."""
        self.also_ready: dict[str, Callable[[], bool]] = {}
        """Model name -> readiness of another engine serving it (text generation), which the
        model's and the server's readiness include."""
        self._background_tasks: list[asyncio.Task[None]] = []
        self.audit = AuditLog(config.audit_log).check("audit_log") if config.audit_log else None
        """Where admin changes and alias-following deploys are recorded (`audit_log`)."""
        self.drift = DriftMonitor(config.drift, metrics)
        if config.drift.enabled:
            self.background.append(self.drift.run)

    @property
    def ready(self) -> bool:
        """Every served version is ready (the OIP server readiness)."""
        return (
            self._started
            and all(mv.ready for mv in self.all_versions())
            and all(ready() for ready in self.also_ready.values())
        )

    @classmethod
    def from_source(
        cls,
        source: ModelSource,
        config: ServeConfig,
        metrics: ServeMetrics,
        seed: int | None = None,
        trust_code: bool = False,
    ) -> Router:
        router = cls(config, metrics, seed, trust_code)
        key = config.signature_key()
        names = dict.fromkeys([*source.models, *config.models])
        for name in names:
            mcfg = config.for_model(name)
            paths = dict(source.models.get(name, {}))
            for version, vcfg in mcfg.versions.items():
                if vcfg.path is not None:
                    paths[version] = Path(vcfg.path)
            if not paths:
                continue
            # Instances compute in parallel threads, each with its own intra-op team: split the
            # cores between them rather than oversubscribing (which costs 10x on a busy CPU).
            threads = mcfg.threads or max(1, (os.cpu_count() or 1) // mcfg.instances)
            versions = {}
            for version, path in paths.items():
                if key is not None:  # before anything of it is read or built
                    verify_export(path, key)
                vcfg_or_none = mcfg.versions.get(version)
                backend_name = (vcfg_or_none.backend if vcfg_or_none else None) or mcfg.backend
                isolation = mcfg.isolation
                if isolation == "auto":
                    isolation = "thread" if backend_name.startswith("onnx") else "process"
                instances = [
                    make_backend(
                        backend_name, path, threads, mcfg.device, isolation, router.trust_code
                    )
                    for _ in range(mcfg.instances)
                ]
                versions[version] = router._version(
                    name, version, path, backend_name, instances, mcfg
                )
            model = ServedModel(name, versions, TrafficPolicy({}))
            newest = model.newest.version
            policy = TrafficPolicy(
                dict(mcfg.traffic) or {newest: 1.0},
                mcfg.shadow.version if mcfg.shadow else None,
                mcfg.shadow.fraction if mcfg.shadow else 1.0,
            )
            try:
                model.policy = check_policy(model, policy)
            except PolicyError as exc:
                from hpcml.errors import ConfigError

                raise ConfigError(f"serve config for model '{name}': {exc}") from None
            router.models[name] = model
        return router

    def _version(
        self,
        name: str,
        version: str,
        path: Path,
        backend_name: str,
        instances: list[Backend],
        mcfg: ModelServeConfig,
    ) -> ModelVersion:
        first = instances[0]
        self.drift.add(name, version, Path(path))
        batcher = DynamicBatcher(
            instances,
            max_batch_size=mcfg.max_batch_size,
            max_queue_delay_ms=mcfg.max_queue_delay_ms,
            preferred_batch_sizes=mcfg.preferred_batch_sizes,
            max_queue_size=mcfg.max_queue_size,
            metrics=self.metrics.for_batcher(name, version),
            on_restart=self.worker_restarts.labels(name, version).inc,
            batch_timeout_s=mcfg.hang_after_s,
        )
        return ModelVersion(
            name,
            version,
            Path(path),
            backend_name,
            first.platform,
            first.input,
            first.output,
            mcfg,
            batcher,
        )

    def all_versions(self) -> list[ModelVersion]:
        return [mv for m in self.models.values() for mv in m.versions.values()]

    def load(self) -> None:
        """Load every backend instance now (the CLI does this before the server starts, so a
        missing file is one clear error instead of a failed ASGI startup)."""
        pending = [
            b
            for mv in self.all_versions()
            for b in mv.batcher.instances
            if id(b) not in self._loaded
        ]
        if not pending:
            return
        # In parallel: a process instance spends its load time importing torch in the child.
        with ThreadPoolExecutor(len(pending)) as pool:
            futures = [pool.submit(b.load) for b in pending]
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            for b, f in zip(pending, futures, strict=True):
                if f.exception() is None:
                    b.close()
            raise errors[0]  # type: ignore[misc]
        self._loaded.update(id(b) for b in pending)

    async def start(self) -> None:
        """Load what `load` has not (in a thread: loading blocks) and start the batchers."""
        await asyncio.to_thread(self.load)
        for mv in self.all_versions():
            await mv.batcher.start()
            mv.started = True
        self._started = True
        self._background_tasks = [asyncio.create_task(run()) for run in self.background]

    async def close(self) -> None:
        self._started = False
        for task in self._background_tasks:
            task.cancel()
        await asyncio.gather(*self._background_tasks, return_exceptions=True)
        for mv in self.all_versions():
            mv.started = False
        await asyncio.gather(*(mv.batcher.close() for mv in self.all_versions()))
        if self._shadow_tasks:
            await asyncio.gather(*self._shadow_tasks, return_exceptions=True)
        await self.drift.close()
        for mv in self.all_versions():
            for backend in mv.batcher.instances:
                await asyncio.to_thread(backend.close)

    def model(self, name: str) -> ServedModel:
        found = self.models.get(name)
        if found is None:
            known = ", ".join(sorted(self.models)) or "none"
            raise NotFound(f"model '{name}' is not served here; served models: {known}.")
        return found

    def pick(self, model: ServedModel) -> ModelVersion:
        weights = model.policy.weights
        if len(weights) == 1:
            return model.versions[next(iter(weights))]
        versions = list(weights)
        chosen = self._rng.choices(versions, weights=[weights[v] for v in versions])[0]
        return model.versions[chosen]

    async def infer(
        self, name: str, version: str | None, prepare: Callable[[ModelVersion], np.ndarray]
    ) -> tuple[ModelVersion, InferResult]:
        """Route a request to a version and wait for its answer; unversioned ones may be mirrored.

        `prepare(version) -> array` checks the request against the chosen version's signature
        (versions of one model may differ) before anything is queued.
        """
        model = self.model(name)
        policy = model.policy
        mv = model.version(version) if version is not None else self.pick(model)
        x = prepare(mv)
        timeout_s = mv.config.timeout_ms / 1000.0
        shadow_task = None
        shadow_version = policy.shadow_version
        if (
            version is None
            and policy.shadow_version is not None
            and policy.shadow_version != mv.version
            and self._rng.random() < policy.shadow_fraction
        ):
            shadow_mv = model.versions[policy.shadow_version]
            shadow_task = asyncio.create_task(self._shadow_infer(shadow_mv, x))
        try:
            result = await mv.batcher.infer(x, timeout_s)
        except BaseException:
            if shadow_task is not None:
                self._keep(asyncio.create_task(self._forget(shadow_task)))
            raise
        self.drift.observe(mv.model, mv.version, x)
        if shadow_task is not None:
            assert shadow_version is not None
            self._keep(
                asyncio.create_task(self._compare(model, shadow_version, result, shadow_task))
            )
        return mv, result

    def _keep(self, task: asyncio.Task[None]) -> None:
        self._shadow_tasks.add(task)
        task.add_done_callback(self._shadow_tasks.discard)

    async def _shadow_infer(
        self, mv: ModelVersion, x: np.ndarray
    ) -> tuple[InferResult | None, float, str]:
        started = time.perf_counter()
        try:
            result = await mv.batcher.infer(x, mv.config.timeout_ms / 1000.0)
        except Exception as exc:  # noqa: BLE001 - a shadow failure is recorded, never raised
            return None, 0.0, type(exc).__name__
        return result, time.perf_counter() - started, "ok"

    async def _forget(self, task: asyncio.Task[Any]) -> None:
        await asyncio.gather(task, return_exceptions=True)

    async def _compare(
        self, model: ServedModel, shadow_version: str, result: InferResult, task: asyncio.Task[Any]
    ) -> None:
        shadow_result, latency_s, reason = await task
        stats = model.shadow_stats.setdefault(shadow_version, ShadowStats())
        stats.requests += 1
        m = self.metrics
        if shadow_result is None:
            outcome = "dropped" if reason in ("QueueFull", "BatcherClosed") else "failed"
            if outcome == "dropped":
                stats.dropped += 1
            else:
                stats.failed += 1
            m.shadow_requests.labels(model.name, shadow_version, outcome).inc()
            return
        a, b = result.output, shadow_result.output
        if a.shape != b.shape:
            disagree = a.shape[0]
            diff = float("inf")
        else:
            if a.ndim == 2 and a.shape[1] > 1:
                # Classifier logits: what the user sees is the top class.
                disagree = int(np.count_nonzero(a.argmax(1) != b.argmax(1)))
            else:
                close = np.isclose(a, b, rtol=1e-3, atol=1e-4).reshape(a.shape[0], -1).all(1)
                disagree = int(np.count_nonzero(~close))
            diff = (
                float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))
                if a.size
                else 0.0
            )
        stats.samples += a.shape[0]
        stats.disagreements += disagree
        stats.max_abs_diff = max(stats.max_abs_diff, diff)
        stats.latency_s_sum += latency_s
        stats.primary_latency_s_sum += result.queue_s + result.compute_s
        m.shadow_requests.labels(model.name, shadow_version, "compared").inc()
        m.shadow_samples.labels(model.name, shadow_version).inc(a.shape[0])
        # Counted at 0 too: a series that exists tells "compared, none differ" from "no shadow".
        m.shadow_disagreements.labels(model.name, shadow_version).inc(disagree)
        m.shadow_latency.labels(model.name, shadow_version).observe(latency_s)

    # Traffic changes (admin endpoints). Each replaces the policy in one assignment.
    def set_policy(self, name: str, policy: TrafficPolicy) -> dict[str, Any]:
        model = self.model(name)
        policy = check_policy(model, policy)
        if policy != model.policy:
            model.history.append(model.policy)
            model.policy = policy
        return model.describe()

    def set_traffic(self, name: str, weights: dict[str, float]) -> dict[str, Any]:
        current = self.model(name).policy
        return self.set_policy(
            name, TrafficPolicy(dict(weights), current.shadow_version, current.shadow_fraction)
        )

    def promote(self, name: str, version: str) -> dict[str, Any]:
        current = self.model(name).policy
        shadow = current.shadow_version if current.shadow_version != version else None
        return self.set_policy(name, TrafficPolicy({version: 1.0}, shadow, current.shadow_fraction))

    def set_shadow(self, name: str, version: str | None, fraction: float = 1.0) -> dict[str, Any]:
        if not 0.0 < fraction <= 1.0:
            raise PolicyError("shadow fraction must be in (0, 1].")
        current = self.model(name).policy
        return self.set_policy(name, TrafficPolicy(dict(current.weights), version, fraction))

    def rollback(self, name: str) -> dict[str, Any]:
        model = self.model(name)
        if not model.history:
            raise PolicyError(f"model '{name}' has no earlier traffic policy to roll back to.")
        model.policy = model.history.pop()
        return model.describe()
