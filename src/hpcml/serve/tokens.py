"""Who may call what: bearer tokens with roles, model scopes and rate limits (`--tokens FILE`).

The tokens file (YAML or JSON, read with `yaml.safe_load`) lists tokens by the SHA-256 of
their text, never the text itself:

    tokens:
      - name: ci-bot                 # who, in the audit log and the registry's tags
        sha256: 9f86d0...            # sha256 of the token (64 hex digits)
        roles: [admin]               # any of infer, read, admin
        models: [digits]             # optional: only these models
        rate_limit: {requests_per_s: 20, burst: 40}   # optional, per token

Each endpoint needs one role (`required_role`); `admin` holds every role. A presented token is
hashed and compared with every entry in constant time (`hmac.compare_digest`, no early exit),
so the answer's timing says nothing about which entry came close. Tokens never reach a log:
only their names do. Without a tokens file the server keeps its old contract: anyone may infer
and read, and the admin endpoints take the token of `admin_token_env` (a principal named
`admin-token`) or are off.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hpcml.errors import ConfigError

Role = Literal["infer", "read", "admin"]
Need = Literal["open", "meta", "infer", "read", "admin_read", "admin"]
"""What an endpoint needs: open (health probes), meta (server and model metadata: infer or
read), infer, read (metrics, statistics), admin_read (the admin endpoints' reads: the read
role, but never a caller without a token), admin (changes)."""
ADMIN_TOKEN_NAME = "admin-token"
PRINCIPAL_KEY = "hpcml.principal"
"""Where the HTTP layer leaves the caller's `Principal` in the ASGI scope's state."""

_INFER_POST = re.compile(
    r"/v2/models/[^/]+(/versions/[^/]+)?/(infer|generate|generate_stream)|/v1/(chat/)?completions"
)
_META_GET = re.compile(r"/v2|/v2/models/[^/]+(/versions/[^/]+)?(/ready)?|/v1/models")
_MODEL_IN_PATH = re.compile(r"/(?:v2|admin)/models/(?P<name>[^/]+)")
_MODEL_IN_BODY = re.compile(r"/v1/(chat/)?completions")
_NOT_MODEL_NAMES = {"stats"}  # /v2/models/stats covers every model


def required_role(method: str, path: str) -> Need:
    """The role `method path` needs (HTTP)."""
    if path in ("/v2/health/live", "/v2/health/ready"):
        return "open"
    if method == "POST" and _INFER_POST.fullmatch(path):
        return "infer"
    if path == "/admin" or path.startswith("/admin/"):
        return "admin_read" if method in ("GET", "HEAD") else "admin"
    if method in ("GET", "HEAD") and _META_GET.fullmatch(path):
        return "meta"
    return "read"


BODY = "<named in the body>"
"""`model_in_path` of the OpenAI endpoints: their handlers check the scope (`forbidden_model`)."""


def model_in_path(path: str) -> str | None:
    """The model an HTTP path names, `BODY` where the body names it, or None for a path about
    every model (or none)."""
    if _MODEL_IN_BODY.fullmatch(path):
        return BODY
    found = _MODEL_IN_PATH.match(path)
    if found is None or found["name"] in _NOT_MODEL_NAMES:
        return None
    return found["name"]


GRPC_NEEDS: dict[str, Need] = {
    "ServerLive": "open",
    "ServerReady": "open",
    "ServerMetadata": "meta",
    "ModelMetadata": "meta",
    "ModelReady": "meta",
    "ModelInfer": "infer",
}
"""gRPC methods of inference.GRPCInferenceService; any other (Triton's ModelConfig,
ModelStatistics, RepositoryIndex) needs `read`. grpc.health.v1.Health is open."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class RateLimitSpec(_Strict):
    requests_per_s: float = Field(gt=0)
    """Sustained requests per second this token may send."""
    burst: int = Field(default=1, gt=0)
    """Requests it may send at once after a quiet spell (the bucket's size)."""


class TokenSpec(_Strict):
    name: str = Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_.@:\-]+$")
    sha256: str = Field(pattern=r"^[0-9a-fA-F]{64}$")
    roles: list[Role] = Field(min_length=1)
    models: list[str] | None = None
    rate_limit: RateLimitSpec | None = None


class TokensFile(_Strict):
    tokens: list[TokenSpec] = Field(min_length=1)


class RateLimit:
    """A token bucket: `burst` requests at once, refilled at `per_s` a second."""

    def __init__(self, per_s: float, burst: int) -> None:
        self.per_s, self.burst = per_s, burst
        self.level = float(burst)
        self.at = time.monotonic()

    def take(self) -> float:
        """0 when a request may go now (and it is counted), else seconds until one may."""
        now = time.monotonic()
        self.level = min(self.burst, self.level + (now - self.at) * self.per_s)
        self.at = now
        if self.level >= 1.0:
            self.level -= 1.0
            return 0.0
        return (1.0 - self.level) / self.per_s


@dataclass
class Principal:
    """A caller the server knows: a token's name, roles, models (None: all) and its bucket."""

    name: str
    roles: frozenset[str]
    models: frozenset[str] | None = None
    limit: RateLimit | None = field(default=None, repr=False)
    digest: bytes = field(default=b"", repr=False)

    def holds(self, need: Need) -> bool:
        if need == "open" or "admin" in self.roles:
            return True
        if need == "meta":
            return bool(self.roles & {"infer", "read"})
        if need == "admin_read":
            return "read" in self.roles
        return need in self.roles

    def may_use(self, model: str | None, need: Need) -> bool:
        """Whether the scope admits `model` (None: an endpoint about every model, which a
        scoped token may call only for server metadata)."""
        if self.models is None or need == "open":
            return True
        return model in self.models if model is not None else need == "meta"


ANONYMOUS_OPEN = Principal("anonymous", frozenset({"infer", "read"}))
"""The caller without a token on a server without a tokens file: as before roles existed."""


def load_tokens(path: str | Path) -> list[Principal]:
    """The principals of a tokens file; ConfigError in one sentence on any mistake."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"tokens file {str(path)!r} is not a file; pass --tokens FILE.")
    try:
        data = yaml.safe_load(file.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        raise ConfigError(
            f"tokens file {str(path)!r} is not readable YAML or JSON; fix its syntax."
        ) from None
    try:
        spec = TokensFile.model_validate(data)
    except ValidationError as err:
        e = err.errors()[0]
        where = ".".join(str(p) for p in e["loc"]) or "(top level)"
        raise ConfigError(
            f"tokens file {str(path)!r}: {where} is not allowed ({e['msg']}); see the "
            "security guide for the format."
        ) from None
    names = [t.name for t in spec.tokens]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"tokens file {str(path)!r} names {twice[0]!r} twice; names are unique.")
    return [
        Principal(
            t.name,
            frozenset(t.roles),
            frozenset(t.models) if t.models is not None else None,
            RateLimit(t.rate_limit.requests_per_s, t.rate_limit.burst) if t.rate_limit else None,
            bytes.fromhex(t.sha256),
        )
        for t in spec.tokens
    ]


class Refusal(Exception):
    """An answer in one sentence: 401 (who are you), 403 (not yours) or 429 (slow down)."""

    def __init__(self, status: int, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.retry_after_s = status, message, retry_after_s


class Authorizer:
    """Turns (token, what is asked) into a Principal or a Refusal. Built once per server."""

    def __init__(self, principals: list[Principal], admin_token: str | None = None) -> None:
        self.principals = list(principals)
        self.tokens_file = bool(principals)
        if admin_token:  # --admin-token-env: the old single token, as an admin principal
            digest = hashlib.sha256(admin_token.encode()).digest()
            self.principals.append(Principal(ADMIN_TOKEN_NAME, frozenset({"admin"}), None,
                                             None, digest))  # fmt: skip
        self.admin_possible = bool(self.principals)

    def lookup(self, token: str) -> Principal | None:
        """The principal whose hash matches `token`: every entry is compared, in constant time."""
        digest = hashlib.sha256(token.encode()).digest()
        found = None
        for principal in self.principals:
            if hmac.compare_digest(digest, principal.digest):
                found = principal
        return found

    def check(self, token: str | None, need: Need, model: str | None, what: str) -> Principal:
        """The caller allowed to do `what` (e.g. "POST /admin/models/m/traffic"), or Refusal."""
        anonymous = None if self.tokens_file else ANONYMOUS_OPEN
        if need == "open":
            return anonymous or Principal("anonymous", frozenset())
        principal = self.lookup(token) if token else None
        if principal is None and anonymous is not None and not need.startswith("admin"):
            return anonymous  # no tokens file: only admin endpoints ever ask for a token
        if principal is None:
            if not self.admin_possible:
                raise Refusal(403, "admin endpoints are disabled: start the server with "
                              "admin_token_env naming an environment variable that holds a "
                              "token, or with --tokens FILE.")  # fmt: skip
            said = "an unknown token" if token else "no token"
            raise Refusal(401, f"{what} needs 'Authorization: Bearer <token>' with a token the "
                          f"server knows, and this request sent {said}.")  # fmt: skip
        if not principal.holds(need):
            role = {"meta": "infer or read", "admin_read": "read"}.get(need, need)
            raise Refusal(403, f"token {principal.name!r} (roles {sorted(principal.roles)}) may "
                          f"not {what}: it needs the {role} role.")  # fmt: skip
        if model is not BODY and not principal.may_use(model, need):
            subject = f"model {model!r}" if model else "every model at once"
            raise Refusal(403, f"token {principal.name!r} is limited to models "
                          f"{sorted(principal.models or ())} and may not {what}, which touches "
                          f"{subject}.")  # fmt: skip
        if principal.limit is not None:
            wait_s = principal.limit.take()
            if wait_s > 0:
                raise Refusal(429, f"token {principal.name!r} is over its rate limit of "
                              f"{principal.limit.per_s:g} requests/s; retry in {wait_s:.2f} s.",
                              wait_s)  # fmt: skip
        return principal


def bearer(header: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header value (scheme case-insensitive)."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def principal_of(scope: Mapping[str, Any]) -> Principal | None:
    """The caller the HTTP gate let in (None where no gate ran: a test's bare app)."""
    state = scope.get("state")
    return state.get(PRINCIPAL_KEY) if isinstance(state, dict) else None


def forbidden_model(scope: Mapping[str, Any], model: str, what: str) -> str | None:
    """For endpoints naming their model in the body (/v1/completions): the 403 sentence when
    the caller's scope excludes `model`, else None."""
    principal = principal_of(scope)
    if principal is None or principal.may_use(model, "infer"):
        return None
    return (
        f"token {principal.name!r} is limited to models {sorted(principal.models or ())} and "
        f"may not {what} with model {model!r}."
    )
