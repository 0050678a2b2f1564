"""Alias-following deploys: `hpcml serve models:/NAME@ALIAS --follow` tracks the registry.

`AliasFollower` polls the MLflow registry every `poll_s`. When the alias points at another
version, it resolves it (the artifact's sha256 is checked against the version's tag by
`resolve_model`), loads it beside the serving version and warms it with one forward pass per
instance. Without a `canary` in the model's serve config it then moves all traffic to it in one
policy swap and retires the old version: requests already queued there finish on it, new ones
go to the new version, so no request fails. With one, the new version is a candidate that
takes the traffic in steps (`hpcml.serve.traffic.canary`), judged at each poll on its own
requests: it is served alone once the last step passes (tagged `hpcml.canary.decision:
completed`), and on an SLO breach the traffic goes back at once, the candidate is retired, the
alias is moved back to the serving version and the candidate tagged with the reason
(`rolled_back`). An alias moved elsewhere during a canary ends it (`abandoned`) before the new
target is deployed. A version that cannot be served (checksum mismatch, load error) or was
rolled back is skipped until the alias moves again; the old version keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path
from typing import Any, Literal

import numpy as np

from hpcml.errors import HpcmlError
from hpcml.serve.codec.oip import DATATYPES
from hpcml.serve.traffic.canary import Canary
from hpcml.serve.traffic.router import Router
from hpcml.serve.traffic.versions import ModelVersion, TrafficPolicy

log = logging.getLogger("hpcml.serve.traffic.follow")
Decision = Literal["completed", "rolled_back", "abandoned"]


async def add_version(router: Router, name: str, version: str, path: Path) -> ModelVersion:
    """Load `version` of a served model beside its others and warm it; no traffic yet."""
    from hpcml.serve.runtime.backends import make_backend

    model = router.model(name)
    mcfg = router.config.for_model(name)
    key = router.config.signature_key()
    if key is not None:  # a refusal here keeps the served version (AliasFollower.check_once)
        from hpcml.models.signing import verify_export

        await asyncio.to_thread(verify_export, path, key)
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
        """The registry version now served (during a canary: the one it may fall back to)."""
        self.poll_s = poll_s
        self.tracking_uri = tracking_uri
        self.skipped: str | None = None
        """A version that could not be served or was rolled back; not retried until the alias
        moves again."""
        self.deploys = 0
        self.slo = router.config.for_model(served_name).canary
        self.canary: Canary | None = None
        """The canary in flight (with a `canary` serve config), else None."""
        self.unrecorded: Canary | None = None
        """A rolled-back canary whose registry record (alias back, tags) has yet to succeed."""
        self.clock = time.monotonic

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
        """Deploy the version the alias points at if it changed, or judge the canary in flight;
        True when the version served changed or a canary began."""
        from hpcml.track.resolve import resolve_model

        if self.unrecorded is not None:
            await self._record_rollback()
        target = await asyncio.to_thread(self._alias_version)
        if self.canary is not None:
            if target == self.canary.candidate:
                return await self._judge()
            await self._abandon(target)
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
        if self.slo is not None:
            self.canary = Canary(new, self.version, self.slo)
            self._apply_step(new)
            await self._audit("canary.start", f"the alias moved to version {new}",
                              version=new, share=self.canary.share)  # fmt: skip
            log.warning(
                "%s moved to version %s: canary at %.0f%% of traffic (version %s serves the rest)",
                self.uri, new, 100 * self.canary.share, self.version,
            )  # fmt: skip
            return True
        await self._switch(new)
        return True

    async def _switch(self, new: str) -> None:
        """All traffic to `new`, then retire the version served until now."""
        old = self.version
        self.router.set_policy(self.served_name, TrafficPolicy({new: 1.0}))
        self.version, self.skipped = new, None
        await self._audit("deploy.switch", f"the alias moved to version {new}",
                          version=new, previous=old)  # fmt: skip
        await retire_version(self.router, self.served_name, old)
        self.deploys += 1
        log.warning("%s moved: now serving version %s (was %s)", self.uri, new, old)

    def _apply_step(self, candidate: str) -> None:
        """The current step's traffic, and a fresh window on the candidate's own requests."""
        assert self.canary is not None
        model = self.router.model(self.served_name)
        self.canary.window.started_s = self.clock()
        model.versions[candidate].stats.window = self.canary.window
        self.router.set_policy(self.served_name, TrafficPolicy(self.canary.weights()))
        model.canary = self.canary.evidence()

    async def _judge(self) -> bool:
        canary = self.canary
        assert canary is not None
        verdict = canary.check(self.clock())
        if verdict == "hold":
            self.router.model(self.served_name).canary = canary.evidence()
            return False
        if verdict == "next":
            self._apply_step(canary.candidate)
            await self._audit("canary.step", "the step before passed its SLO",
                              version=canary.candidate, share=canary.share)  # fmt: skip
            log.warning(
                "%s version %s: canary step %d, %.0f%% of traffic",
                self.uri, canary.candidate, canary.step + 1, 100 * canary.share,
            )  # fmt: skip
            return False
        self.canary = None
        self.router.model(self.served_name).canary = None
        if verdict == "done":
            evidence = canary.evidence()
            await self._switch(canary.candidate)
            await self._record(canary.candidate, "completed", "every canary step passed its SLO",
                               evidence)  # fmt: skip
            return True
        await self._roll_back(canary)
        return False

    async def _roll_back(self, canary: Canary) -> None:
        """Traffic back first (the next request is safe), then the registry (alias back to the
        served version, so other servers following it roll back too; the candidate tagged with
        the reason), then retire the candidate once it has answered what it had queued."""
        self.router.set_policy(self.served_name, TrafficPolicy({self.version: 1.0}))
        self.skipped = canary.candidate
        self.unrecorded = canary
        await self._audit("canary.rollback", canary.reason, version=canary.candidate,
                          back_to=self.version)  # fmt: skip
        log.error(
            "%s version %s rolled back to version %s: %s",
            self.uri, canary.candidate, self.version, canary.reason,
        )  # fmt: skip
        await self._record_rollback()
        await retire_version(self.router, self.served_name, canary.candidate)

    async def _record_rollback(self) -> None:
        """The registry's part of a rollback; retried at the next poll while it fails."""
        from hpcml.track.audit import Attribution, os_user
        from hpcml.track.registry import roll_back_alias
        from hpcml.track.resolve import parse_model_uri

        canary = self.unrecorded
        assert canary is not None
        name, alias, _ = parse_model_uri(self.uri)
        assert alias is not None
        evidence = canary.evidence()
        by = Attribution(os_user(), f"canary rolled back: {canary.reason}", self.router.audit)
        try:
            evidence["alias_moved_back"] = await asyncio.to_thread(
                roll_back_alias, name, alias, canary.candidate, canary.previous,
                self.tracking_uri, by,
            )  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - the registry may be briefly unreachable
            log.error(
                "could not move %s back to version %s (%s); retrying at the next poll",
                self.uri, canary.previous, exc,
            )  # fmt: skip
            return
        self.unrecorded = None
        await self._record(canary.candidate, "rolled_back", canary.reason, evidence)

    async def _abandon(self, target: str) -> None:
        """The alias left the candidate during its canary: back to the served version."""
        canary = self.canary
        assert canary is not None
        self.canary = None
        self.router.model(self.served_name).canary = None
        evidence = canary.evidence()
        self.router.set_policy(self.served_name, TrafficPolicy({self.version: 1.0}))
        await retire_version(self.router, self.served_name, canary.candidate)
        why = f"the alias moved to version {target} during the canary"
        log.warning("%s version %s: canary ended, %s", self.uri, canary.candidate, why)
        await self._audit("canary.abandon", why, version=canary.candidate, back_to=self.version)
        await self._record(canary.candidate, "abandoned", why, evidence)

    async def _record(
        self, version: str, decision: Decision, reason: str, evidence: dict[str, Any]
    ) -> None:
        """Tag the version with the canary's outcome; a registry that cannot be written is
        logged (the served traffic is already right)."""
        from hpcml.track.registry import record_canary
        from hpcml.track.resolve import parse_model_uri

        name = parse_model_uri(self.uri)[0]
        try:
            await asyncio.to_thread(
                record_canary, name, version, decision, reason, evidence, self.tracking_uri
            )
        except Exception as exc:  # noqa: BLE001 - the registry may be briefly unreachable
            log.error("could not record the canary of %s version %s: %s", self.uri, version, exc)

    async def _audit(self, action: str, reason: str, **details: Any) -> None:
        """A traffic change of this follower in the audit log (when the server keeps one),
        under the OS user running the server."""
        audit = self.router.audit
        if audit is None:
            return
        from hpcml.track.audit import os_user

        try:
            await asyncio.to_thread(audit.append, os_user(), action, self.served_name, reason,
                                    uri=self.uri, **details)  # fmt: skip
        except OSError as exc:  # a full disk must not stop a rollback halfway
            log.error("could not append to the audit log %s: %s", audit.path, exc)

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
