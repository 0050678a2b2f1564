"""The admin endpoints: read the models' versions and traffic, and change them (traffic split,
promote, rollback, shadow). The token gate (`gate`) has already let the caller in with the
role each needs; every change that succeeds is appended to the audit log (`audit_log`) under
the caller's token name, with the `reason` the body may give."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import Body, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from hpcml.serve.tokens import principal_of
from hpcml.serve.traffic.router import Router
from hpcml.serve.traffic.versions import NotFound, PolicyError

log = logging.getLogger("hpcml.serve.admin")
Weight = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
Reason = Field("", max_length=2000, description="Why: kept in the audit log.")


class TrafficBody(BaseModel):
    weights: dict[str, Weight] = Field(
        description='Version -> finite, non-negative weight, e.g. {"1": 90, "2": 10}.'
    )
    reason: str = Reason


class PromoteBody(BaseModel):
    version: str
    reason: str = Reason


class ShadowBody(BaseModel):
    version: str | None = Field(description="Candidate version; null turns shadowing off.")
    fraction: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    reason: str = Reason


class RollbackBody(BaseModel):
    reason: str = Reason


def add_admin_routes(
    app: FastAPI, router: Router, error: Callable[[int, str], Response]
) -> None:
    def answer(call: Callable[[], dict[str, Any]]) -> Response | dict[str, Any]:
        try:
            return call()
        except NotFound as exc:
            return error(404, str(exc))
        except PolicyError as exc:
            return error(400, str(exc))

    async def change(
        request: Request, action: str, name: str, reason: str, call: Callable[[], dict[str, Any]],
        **details: Any,
    ) -> Response:  # fmt: skip
        done = answer(call)
        if isinstance(done, Response):
            return done
        if router.audit is not None:
            principal = principal_of(request.scope)
            actor = principal.name if principal is not None else "anonymous"
            try:
                await asyncio.to_thread(
                    router.audit.append, actor, action, name, reason,
                    traffic=done.get("traffic"), **details,
                )  # fmt: skip
            except OSError as exc:  # the change stands; the operator must see the gap
                log.error("%s of %s by %s is not in the audit log %s: %s",
                          action, name, actor, router.audit.path, exc)  # fmt: skip
        return JSONResponse(done)

    def read(call: Callable[[], dict[str, Any]]) -> Response:
        done = answer(call)
        return done if isinstance(done, Response) else JSONResponse(done)

    tags: dict[str, Any] = {"tags": ["admin"]}

    @app.get("/admin/models", **tags)
    async def admin_models() -> Response:
        return read(lambda: {"models": [m.describe() for m in router.models.values()]})

    @app.get("/admin/models/{name}", **tags)
    async def admin_model(name: str) -> Response:
        return read(lambda: router.model(name).describe())

    @app.post("/admin/models/{name}/traffic", **tags)
    async def admin_traffic(name: str, request: Request, body: TrafficBody = Body(...)) -> Response:
        return await change(request, "traffic", name, body.reason,
                            lambda: router.set_traffic(name, body.weights),
                            weights=body.weights)  # fmt: skip

    @app.post("/admin/models/{name}/promote", **tags)
    async def admin_promote(name: str, request: Request, body: PromoteBody = Body(...)) -> Response:
        return await change(request, "promote", name, body.reason,
                            lambda: router.promote(name, body.version),
                            version=body.version)  # fmt: skip

    @app.post("/admin/models/{name}/rollback", **tags)
    async def admin_rollback(
        name: str, request: Request, body: RollbackBody | None = Body(None)
    ) -> Response:
        reason = body.reason if body is not None else ""
        return await change(request, "rollback", name, reason, lambda: router.rollback(name))

    @app.post("/admin/models/{name}/shadow", **tags)
    async def admin_shadow(name: str, request: Request, body: ShadowBody = Body(...)) -> Response:
        return await change(request, "shadow", name, body.reason,
                            lambda: router.set_shadow(name, body.version, body.fraction),
                            version=body.version, fraction=body.fraction)  # fmt: skip
