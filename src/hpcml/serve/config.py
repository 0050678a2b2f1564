"""The `hpcml serve` configuration: server limits, per-model batching, versions and traffic.

A YAML file (`hpcml serve PATH --config serve.yaml`) fills `ServeConfig`; command-line options
override its top-level fields. Unknown keys are errors, as in the training config.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from hpcml.config_sections import TlsConfig
from hpcml.errors import ConfigError

BackendName = Literal["torch", "compile", "onnx", "onnx-int8"]


def normalise_weights(weights: dict[str, float]) -> dict[str, float]:
    """Traffic weights as shares summing to 1, or ValueError saying what is wrong.

    Checked as a whole: each weight finite and non-negative, and one positive. Weights whose sum
    overflows (1e308 + 1e308) are divided by the largest first, so the shares stay finite."""
    bad = [f"{v!r}: {w!r}" for v, w in weights.items() if not math.isfinite(w) or w < 0]
    if bad:
        raise ValueError(f"traffic weights must be finite and non-negative numbers, got {bad[0]}")
    largest = max(weights.values(), default=0.0)
    if largest <= 0:
        raise ValueError("traffic needs a positive weight on some version")
    total = sum(weights.values())
    if not math.isfinite(total):
        weights = {v: w / largest for v, w in weights.items()}
        total = sum(weights.values())
    return {v: w / total for v, w in weights.items()}


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ShadowConfig(_Section):
    version: str
    """Candidate version that receives a copy of unversioned requests; its answer is never sent."""
    fraction: float = Field(default=1.0, gt=0.0, le=1.0)
    """Share of unversioned requests mirrored to the candidate."""


class VersionConfig(_Section):
    path: str | None = None
    """Export folder (or run folder) of this version; null keeps the one found in the repository."""
    backend: BackendName | None = None
    """Overrides the model's backend for this version only."""


class CanaryConfig(_Section):
    """How `hpcml serve models:/NAME@ALIAS --follow` moves traffic to a version the alias moved
    to: in steps, judged on the candidate's own requests (`hpcml.serve.traffic.canary`), and
    rolled back (traffic, and the alias in the registry) when it breaches the SLO."""

    steps: list[float] = Field(default_factory=lambda: [0.1, 0.5, 1.0])
    """The candidate's share of unversioned requests at each step, increasing, each in (0, 1];
    the serving version takes the rest and stays loaded until the last step has passed."""
    step_s: float = Field(default=60.0, gt=0.0, allow_inf_nan=False)
    """Least time a step lasts: it passes once this long has gone by and the candidate has
    answered `min_requests` in it without breaching the SLO. Judged at every registry poll
    (`--poll-s`)."""
    min_requests: int = Field(default=20, gt=0)
    """Candidate requests a step needs before it is judged at all: with fewer (no traffic) the
    step neither passes nor fails, it holds."""
    max_error_rate: float = Field(default=0.01, ge=0.0, lt=1.0, allow_inf_nan=False)
    """SLO: most share of the candidate's requests in a step answered with a server error (5xx:
    a failed forward pass, a timeout, a full queue); client errors (4xx) do not count."""
    max_p99_ms: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)
    """SLO: most 99th percentile (nearest rank) of the latency of the candidate's successful
    requests in a step, from receipt to answer in this server. null: no latency SLO."""

    @field_validator("steps")
    @classmethod
    def _increasing_shares(cls, v: list[float]) -> list[float]:
        if not v:
            raise ValueError("canary steps need at least one share, e.g. [0.1, 0.5, 1.0]")
        if any(not math.isfinite(s) or not 0.0 < s <= 1.0 for s in v):
            raise ValueError("each canary step is a share in (0, 1], e.g. [0.1, 0.5, 1.0]")
        if any(b <= a for a, b in zip(v, v[1:], strict=False)):
            raise ValueError("canary steps must increase, e.g. [0.1, 0.5, 1.0]")
        return v


class ModelServeConfig(_Section):
    backend: BackendName = "torch"
    """torch (eager), compile (torch.compile), onnx (model.onnx), onnx-int8 (model.int8.onnx)."""
    isolation: Literal["auto", "process", "thread"] = "auto"
    """Where instances compute: process (a child process each, so the forward pass never waits
    for the server's GIL), thread (in the server, starts faster); auto = process for torch
    backends, thread for ONNX Runtime (which releases the GIL for a whole run)."""
    max_batch_size: int = Field(default=32, gt=0)
    """Most samples merged into one forward pass; a request may not carry more than this."""
    max_queue_delay_ms: float = Field(default=0.0, ge=0.0)
    """How long the oldest queued request waits for others before its batch is cut anyway.
    0 (Triton's default too) still batches under load: whatever queued while an instance was
    computing leaves as one batch; a small delay buys bigger batches at moderate load."""
    preferred_batch_sizes: list[int] = Field(default_factory=list)
    """Batches are cut to the largest of these sizes the queue can fill (shape-stable backends)."""
    instances: int = Field(default=1, gt=0)
    """Model copies computing batches concurrently."""
    max_queue_size: int = Field(default=256, gt=0)
    """Samples allowed to wait; beyond it requests are refused at once (503 or 429)."""
    timeout_ms: float = Field(default=10_000.0, gt=0.0)
    """A request not answered within this time gets 504 and its result is dropped."""
    hang_timeout_s: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)
    """An inference process (`isolation: process`) that answers no batch for this long is
    taken as hung (stopped, wedged): it is killed and restarted, its requests get 503 with
    Retry-After, and the version is not ready until the new process has loaded. Keep it above
    the slowest batch's compute time and below `timeout_ms` (else a request waiting on a hung
    process gets the timeout's 504 first); null: half of `timeout_ms`."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where torch backends compute; auto picks cuda when present (ONNX Runtime picks its own)."""
    threads: int | None = Field(default=None, gt=0)
    """Intra-op threads per instance (torch and ONNX Runtime); null splits the cores between
    instances. torch's setting is process-wide: the last model loaded sets it for all."""
    versions: dict[str, VersionConfig] = Field(default_factory=dict)
    """Settings per version name (a number such as `2:` is read as the name "2"): `path` adds the version or replaces its
    folder from the served PATH, `backend` overrides the model's; empty: the versions in PATH."""
    traffic: dict[str, float] = Field(default_factory=dict)
    """Weights of versions for unversioned requests (canary): finite, non-negative, one positive;
    kept as shares summing to 1. Empty sends all to the newest."""
    shadow: ShadowConfig | None = None
    """Mirror a `fraction` of unversioned requests to a candidate `version`, whose answers are
    compared (metrics, admin status) and discarded; it must be served and must not take all the
    traffic. null: no shadow."""

    canary: CanaryConfig | None = None
    """With `--follow`: move traffic to a version the alias moves to in steps and roll back on
    an SLO breach (see CanaryConfig). null: all traffic moves at once."""

    @field_validator("preferred_batch_sizes")
    @classmethod
    def _positive_sizes(cls, v: list[int]) -> list[int]:
        if any(s <= 0 for s in v):
            raise ValueError("preferred batch sizes must be positive")
        return sorted(set(v))

    @field_validator("traffic")
    @classmethod
    def _weights(cls, v: dict[str, float]) -> dict[str, float]:
        return normalise_weights(v) if v else v

    @model_validator(mode="after")
    def _sizes_fit(self) -> ModelServeConfig:
        too_big = [s for s in self.preferred_batch_sizes if s > self.max_batch_size]
        if too_big:
            raise ValueError(f"preferred batch sizes {too_big} exceed max_batch_size")
        if self.hang_timeout_s is not None and self.hang_timeout_s * 1000 >= self.timeout_ms:
            raise ValueError(
                f"hang_timeout_s {self.hang_timeout_s:g} s is not shorter than timeout_ms "
                f"{self.timeout_ms:g} ms, so a request to a hung inference process would time "
                "out (504) before the process is replaced (503 + Retry-After); lower it, or "
                "leave it null (half of timeout_ms)"
            )
        return self

    @property
    def hang_after_s(self) -> float:
        """`hang_timeout_s`, or half of `timeout_ms` when it is null."""
        return self.hang_timeout_s or self.timeout_ms / 2000


class GenerationConfig(_Section):
    """Text generation for `gpt` exports (`/v1/completions`); see `hpcml.serve.generate`."""

    kv_cache_blocks: int = Field(default=512, gt=0)
    """KV cache size in blocks, allocated at startup: the memory bound of generation."""
    block_size: int = Field(default=16, gt=0)
    """Token positions per KV cache block."""
    max_num_seqs: int = Field(default=32, gt=0)
    """Most sequences decoded together in one step."""
    max_batched_tokens: int = Field(default=256, gt=0)
    """Most new tokens in one step: long prompts are prefilled in chunks of at most this."""
    max_prefill_tokens: int | None = Field(default=None, gt=0)
    """Most prompt tokens in a step that also decodes (decodes are planned first): every
    decoding sequence waits for the whole step, so this bounds how much arriving prompts
    lengthen the inter-token latency, at the price of time to first token; a step with no
    decodes prefills up to max_batched_tokens. null: no bound but max_batched_tokens. Worth
    setting where a prompt token costs nearly a decode (a large model with a small
    vocabulary); see the LLM guide's step profile."""
    prefix_sharing: bool = True
    """Sequences whose prompts start with the same full KV blocks share them."""
    watermark_blocks: int = Field(default=1, ge=0)
    """Free KV blocks a sequence's admission must leave while others run (admission takes
    blocks for the whole prompt, or the whole recompute of a preempted sequence, at once)."""
    max_preemptions: int = Field(default=2, ge=1)
    """After this many preemptions a sequence is readmitted holding blocks for its whole
    prompt plus max_tokens, so it is never preempted again."""
    kv_overcommit: float = Field(default=1.25, ge=1.0, allow_inf_nan=False)
    """Admit a sequence only while the running ones at their longest (prompt plus max_tokens)
    need at most this many times the cache: 1.0 never preempts; more admits more sequences
    whose outputs may stop early, at the price of some recompute."""
    max_waiting: int | None = Field(default=None, gt=0)
    """Most sequences of one model waiting for a place in its engine (a request adds one per
    prompt times its n); a request that would make more wait is answered 429 with Retry-After
    at once. null: no bound."""
    request_timeout_s: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)
    """A request not finished this long after it arrived is dropped from the engine (504, or
    an error event when streamed); null: no deadline."""
    quantize: Literal["none", "int8", "bf16"] = "none"
    """int8: weight-only int8 Linear layers (torchao) for the generation engine; bf16: weights,
    activations and KV cache in bfloat16 (fast on CPUs with AMX, and on GPUs)."""
    static_batching: bool = False
    """The baseline of the LLM benchmark: a batch starts only when the previous has ended."""
    step_timeout_s: float = Field(default=60.0, gt=0.0, allow_inf_nan=False)
    """An engine process that has requests but reports no step for this long is taken as hung:
    it is killed and replaced, and its requests fail with the retry sentence."""


class DriftConfig(_Section):
    """Input drift watch (hpcml.serve.traffic.drift): live profile vs the export's reference profile."""

    enabled: bool = True
    """Keep a few input rows of each answered request and compare them every `every_s` with the
    export's reference profile; false keeps nothing and runs no check (nor `command`)."""
    psi_threshold: float = Field(default=0.1, gt=0.0)
    """A feature has drifted when its PSI is over this and its corrected p-value under `alpha`
    (`hpcml.data.drift_compare.compare`)."""
    alpha: float = Field(default=0.001, gt=0.0, lt=1.0)
    """False-alarm rate of one check: the chi-square p-values, times the number of features
    (Bonferroni), are compared with it."""
    window_rows: int = Field(default=1000, gt=0, le=20_000)
    """The live profile is the last this many rows (it forgets older ones); also the tests'
    sample size. Memory: window_rows x features x (bins + 2) x 4 bytes."""
    min_samples: int = Field(default=200, gt=0)
    """Rows in the window before a version's PSI is computed and exported."""
    every_s: float = Field(default=60.0, gt=0.0)
    """Seconds between checks; also the least time between two runs of a model's `command`."""
    command: list[str] | None = None
    """argv run (no shell) when a version first crosses the threshold, with HPCML_MODEL,
    HPCML_VERSION and HPCML_PSI in its environment. From this file only, never a model file."""
    sample_rows: int = Field(default=8, gt=0)
    """Most rows of one request kept for the live profile."""
    max_pending_rows: int = Field(default=4096, gt=0)
    """Rows kept between two checks; more are dropped (and counted) until the next check."""
    max_values_per_check: int = Field(default=65536, gt=0)
    """Most values per feature folded into the live profile by one check (a uniform sample of
    the pending rows' values when they hold more: an image channel has H*W values a row)."""

    @model_validator(mode="after")
    def _window_holds_min_samples(self) -> DriftConfig:
        if self.window_rows < self.min_samples:
            raise ValueError(
                f"window_rows ({self.window_rows}) is under min_samples ({self.min_samples}), "
                "so no check would ever run; raise window_rows or lower min_samples"
            )
        return self

    @field_validator("command")
    @classmethod
    def _argv(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and (not v or not v[0]):
            raise ValueError("the drift command must be a non-empty argv list")
        return v


class ServeConfig(_Section):
    host: str = "127.0.0.1"
    """Address the HTTP server and the gRPC endpoint listen on: 127.0.0.1 this machine only,
    0.0.0.0 every IPv4 interface (`::` for IPv6). `--host` overrides it."""
    port: int = Field(default=8000, ge=0, lt=65536)
    """TCP port of the HTTP endpoints (inference, `/metrics`, admin); `--port` overrides it. 0
    picks a free port (refused with `--prometheus-targets`)."""
    max_body_bytes: int = Field(default=16 * 1024 * 1024, gt=0)
    """Larger request bodies get 413 before they are read in full."""
    max_decoded_bytes: int | None = Field(default=None, gt=0)
    """Most memory the decoded input tensors of one request may take (elements x item size; a
    BYTES element counts 41 bytes besides its data), HTTP and gRPC alike; larger requests get
    413 (gRPC: RESOURCE_EXHAUSTED), checked on the shapes they claim before anything is
    allocated. null: 4 x `max_body_bytes`, which holds any numeric body (JSON's shortest number,
    `0,`, is 2 bytes for an 8-byte FP64)."""
    header_timeout_s: float | None = Field(default=10.0, gt=0.0, allow_inf_nan=False)
    """A connection whose request headers are not complete within this long of the connection
    opening (or of the request's first byte) is closed. null: no bound."""
    body_timeout_s: float | None = Field(default=30.0, gt=0.0, allow_inf_nan=False)
    """A request body not received in full within this long of the request's start gets 408,
    which frees its `limit_concurrency` slot (slow clients cannot hold them all). null: none."""
    overload_status: Literal[503, 429] = 503
    """Status when a queue is full: 503, or 429 with a Retry-After header."""
    retry_after_s: int = Field(default=1, ge=0)
    """Seconds sent in the HTTP `Retry-After` header of refusals a retry may cure: a full queue
    (503 or 429), `limit_concurrency` (503) and a restarting inference process (503)."""
    admin_token_env: str | None = None
    """Environment variable that holds the admin bearer token (a caller named `admin-token`
    with the admin role); with neither it nor `tokens_file`, the admin endpoints are off."""
    tokens_file: str | None = None
    """Bearer tokens with roles (infer, read, admin), model scopes and rate limits, by their
    SHA-256 (`hpcml.serve.tokens`); every endpoint but the health probes then needs one, HTTP
    and gRPC alike. null: inference and reads are open, admin takes `admin_token_env`."""
    tls: TlsConfig | None = None
    """Serve HTTPS and gRPC over TLS with this certificate and key; with `client_ca`, mutual
    TLS (clients without a certificate that CA signed are refused). null: plain text."""
    audit_log: str | None = None
    """Append every admin change (traffic, promote, rollback, shadow) and every canary step,
    switch and rollback to this hash-chained JSON-lines file (`hpcml audit verify`). null: none."""
    graceful_timeout_s: float = Field(default=30.0, gt=0.0)
    """On SIGTERM, in-flight requests get this long to finish."""
    grpc_port: int | None = Field(default=None, ge=0, lt=65536)
    """Port of the OIP v2 gRPC endpoint (inference.GRPCInferenceService) on `host`; null: none.
    0 picks a free port."""
    limit_concurrency: int | None = Field(default=1024, gt=0)
    """Most requests handled at once (HTTP, and gRPC separately); more get 503 with Retry-After
    (gRPC: RESOURCE_EXHAUSTED) at once. Health and metrics endpoints are exempt. null: no limit."""
    tracing: bool = False
    """An OpenTelemetry trace per inference request (receive, queue, compute, respond), sent by
    OTLP/HTTP to $OTEL_EXPORTER_OTLP_ENDPOINT (hpcml.serve.protocol.spans)."""
    json_offload_bytes: int = Field(default=256 * 1024, ge=0)
    """Inference bodies at least this large are parsed in a worker thread, so one large JSON
    body does not hold up every other request on the event loop."""
    require_signature: bool = False
    """Serve only exports signed with `hpcml export sign` whose files match the signature
    (checked against `verify_key` before a model loads, and for every version `--follow`
    deploys); an unsigned or changed one is refused (`--require-signature`)."""
    verify_key: str | None = None
    """The signer's elliptic curve public key (PEM) that `require_signature` checks with
    (`--verify-key`)."""
    defaults: ModelServeConfig = Field(default_factory=ModelServeConfig)
    """Settings for models that `models` does not list."""
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    drift: DriftConfig = Field(default_factory=DriftConfig)
    models: dict[str, ModelServeConfig] = Field(default_factory=dict)

    def signature_key(self) -> Path | None:
        """The public key every served export is checked with, or None when none is required;
        a half-given setting is refused (one sentence)."""
        if self.require_signature and not self.verify_key:
            raise ConfigError(
                "--require-signature needs --verify-key PUB (the signer's public key, PEM)."
            )
        if self.verify_key and not self.require_signature:
            raise ConfigError(
                "--verify-key is used only with --require-signature; pass both, or neither."
            )
        return Path(self.verify_key) if self.verify_key else None

    @property
    def decoded_limit_bytes(self) -> int:
        """`max_decoded_bytes`, or its default of 4 x `max_body_bytes`."""
        return self.max_decoded_bytes or 4 * self.max_body_bytes

    def for_model(self, name: str) -> ModelServeConfig:
        return self.models.get(name, self.defaults)


def _format(err: ValidationError, origin: str) -> str:
    e = err.errors()[0]
    key = ".".join(str(p) for p in e["loc"]) or "(top level)"
    if e["type"] == "extra_forbidden":
        return f"serve config key '{key}' (from {origin}) is not known; check its spelling."
    return (
        f"serve config key '{key}' has value {e.get('input')!r} (from {origin}), which is not "
        f"allowed: {e['msg']}."
    )


def build_serve_config(data: dict, origin: str = "the serve config") -> ServeConfig:
    try:
        return ServeConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format(err, origin)) from None


def load_serve_config(path: Path | None) -> ServeConfig:
    if path is None:
        return ServeConfig()
    if not path.exists():
        raise ConfigError(f"serve config {path} does not exist; pass the path of a YAML file.")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError:
        raise ConfigError(f"serve config {path} is not valid YAML; fix its syntax.") from None
    if not isinstance(data, dict):
        raise ConfigError(f"serve config {path} must hold a mapping at the top level.")
    # YAML reads `1:` as an int; version names are strings in the protocol (under `defaults`
    # as under each model).
    models = data.get("models")
    models = models if isinstance(models, dict) else {}
    for model in [data.get("defaults"), *models.values()]:
        if isinstance(model, dict):
            for key in ("versions", "traffic"):
                if isinstance(model.get(key), dict):
                    model[key] = {str(k): v for k, v in model[key].items()}
            if isinstance(model.get("shadow"), dict) and "version" in model["shadow"]:
                model["shadow"]["version"] = str(model["shadow"]["version"])
    return build_serve_config(data, str(path))
