"""Alias-following deploys: `hpcml serve models:/NAME@ALIAS --follow` tracks the registry.

`AliasFollower` polls the MLflow registry every `poll_s`. When the alias points at another
version, it resolves it (the artifact's sha256 is checked against the version's tag by
`resolve_model`), loads it beside the serving version, warms it with one forward pass per
instance, moves all traffic to it in one policy swap, then retires the old version: requests
already queued there finish on it, new ones go to the new version, so no request fails. A
version that cannot be served (checksum mismatch, load error) is logged in one sentence and
skipped until the alias moves again; the old version keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import numpy as np

from hpcml.errors import HpcmlError
from hpcml.serve.codec.oip import DATATYPES
from hpcml.serve.traffic.router import Router
from hpcml.serve.traffic.versions import ModelVersion, TrafficPolicy

log = logging.getLogger("hpcml.serve.traffic.follow")


async def add_version(router: Router, name: str, version: str, path: Path) -> ModelVersion:
    """Load `version` of a served model beside its others and warm it; no traffic yet."""
    from hpcml.serve.runtime.backends import make_backend

    model = router.model(name)
    mcfg = router.config.for_model(name)
    threads = mcfg.threads or max(1, (os.cpu_count() or 1) // mcfg.instances)
    isolation = mcfg.isolation
    if isolation == "auto":
        isolation = "thread" if mcfg.backend.startswith("onnx") else "process"
    instances = [
        make_backend(mcfg.backend, path, threads, mcfg.device, isolation, router.trust_code)
        for _ in range(mcfg.instances)
    ]
    mv = router._version(name, version, path, mcfg.backend, instances, mcfg)
    try:
        await asyncio.gather(*(asyncio.to_thread(b.load) for b in instances))
        await mv.batcher.start()
        # Warm: a real forward pass per instance before any client's request waits on one.
        x = np.zeros((1, *[max(d, 1) for d in mv.input.shape]), DATATYPES[mv.input.datatype])
        for _ in instances:
            await mv.batcher.infer(x, mcfg.timeout_ms / 1000.0)
    except BaseException:
        await mv.batcher.close()
        for b in instances:
            await asyncio.to_thread(b.close)
        raise
    mv.started = True
    model.versions[version] = mv
    return mv


async def retire_version(router: Router, name: str, version: str) -> None:
    """Take a version that no traffic points at out of its model, let it finish what it has
    queued, then stop its processes."""
    model = router.model(name)
    mv = model.versions.pop(version)
    model.history = [p for p in model.history if version not in p.weights]
    mv.started = False
    await mv.batcher.close()
    for backend in mv.batcher.instances:
        await asyncio.to_thread(backend.close)


class AliasFollower:
    def __init__(
        self,
        router: Router,
        served_name: str,
        uri: str,
        version: str,
        poll_s: float = 10.0,
        tracking_uri: str | None = None,
    ) -> None:
        self.router = router
        self.served_name = served_name
        self.uri = uri
        self.version = version
        """The registry version now served."""
        self.poll_s = poll_s
        self.tracking_uri = tracking_uri
        self.skipped: str | None = None
        """A version that could not be served; not retried until the alias moves again."""
        self.deploys = 0

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                await self.check_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the registry may be briefly unreachable
                log.warning(
                    "following %s: %s; the served version stays %s", self.uri, exc, self.version
                )

    async def check_once(self) -> bool:
        """Deploy the version the alias points at if it changed; True when it did."""
        from hpcml.track.resolve import resolve_model

        target = await asyncio.to_thread(self._alias_version)
        if target in (self.version, self.skipped):
            return False
        try:
            resolved = await asyncio.to_thread(resolve_model, self.uri, self.tracking_uri)
            new = str(resolved.version)
            await add_version(self.router, self.served_name, new, resolved.path)
        except HpcmlError as exc:
            self.skipped = target
            log.error("not deploying %s version %s: %s", self.uri, target, exc.message)
            return False
        old = self.version
        self.router.set_policy(self.served_name, TrafficPolicy({new: 1.0}))
        self.version, self.skipped = new, None
        await retire_version(self.router, self.served_name, old)
        self.deploys += 1
        log.warning("%s moved: now serving version %s (was %s)", self.uri, new, old)
        return True

    def _alias_version(self) -> str:
        from hpcml.track.resolve import alias_version

        return alias_version(self.uri, self.tracking_uri)


def follow(
    router: Router, path: str, poll_s: float, tracking_uri: str | None = None
) -> AliasFollower:
    """Attach a follower of the registry URI `path` to a router built from it."""
    from hpcml.errors import ConfigError
    from hpcml.track.resolve import parse_model_uri

    if not str(path).startswith("models:/") or parse_model_uri(str(path))[1] is None:
        raise ConfigError(
            f"--follow needs a registry alias URI such as models:/NAME@production, not {path}."
        )
    if poll_s <= 0:
        raise ConfigError(f"--poll-s must be a positive number of seconds, not {poll_s:g}.")
    ((name, model),) = router.models.items()
    (version,) = model.versions
    follower = AliasFollower(router, name, str(path), version, poll_s, tracking_uri)
    router.background.append(follower.run)
    return follower
