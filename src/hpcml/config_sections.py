"""Sections of the `RunConfig` tree (`hpcml.config`) about running a job rather than what it
trains: fault tolerance, tracking, observability; and the base every section shares.
`hpcml.config` re-exports all of them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

SECONDS_MAX = 10**9
"""Upper bound of every duration in seconds (about 31 years): below `threading.TIMEOUT_MAX` and
`datetime.timedelta`'s range, which the watchdog, signal waits and process-group timeouts use."""


class _Section(BaseModel):
    # NaN and infinity are refused everywhere: no setting means anything with them.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class TlsConfig(_Section):
    """TLS for an endpoint: PEM files read when it starts (`hpcml.observe.tls`)."""

    cert: str
    """Certificate chain (PEM) the endpoint presents, leaf first."""
    key: str
    """Private key (PEM, unencrypted) of that certificate."""
    client_ca: str | None = None
    """CA bundle (PEM) that client certificates must chain to: mutual TLS, and a client
    without such a certificate is refused in the handshake. null: any client may connect."""


PreemptSignal = Literal["SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP"]


class FaultConfig(_Section):
    """Guards of the training loop (hpcml.train.fault.guard): bad steps, stragglers, hangs, preemption."""

    nan_policy: Literal["skip", "rollback", "stop"] = "skip"
    """A step whose loss is NaN or Inf: drop its update, reload the last checkpoint and skip
    the batch, or stop the run."""
    spike_policy: Literal["skip", "rollback", "stop"] = "skip"
    """The same choice for a loss spike (see spike_zscore)."""
    spike_zscore: float | None = Field(None, gt=0)
    """A loss this many standard deviations above the mean of the last spike_window good steps
    is a spike (no step is checked before that many are seen); null turns spike detection off
    (6 is a cautious value)."""
    spike_window: int = Field(50, ge=5)
    """Recent good steps (finite, not spikes) whose loss mean and standard deviation a loss is
    scored against; detection starts once this many are seen. Used only with `spike_zscore`."""
    max_bad_steps: int = Field(20, gt=0)
    """Stop after this many bad (NaN/Inf/spike) steps in a row: the model will not recover."""
    max_rollbacks: int = Field(5, ge=0)
    """Stop after this many rollbacks in one run."""
    straggler_every: int = Field(50, ge=0)
    """Every N steps the ranks compare their local step times; 0 turns it off."""
    straggler_factor: float = Field(1.5, gt=1)
    """A rank slower than this many times the (lower) median of all ranks is a straggler."""
    straggler_exclude_after: int = Field(3, ge=0)
    """A rank named a straggler at this many checks in a row is a persistent one: its node is
    added to the run folder's `exclude_nodes`, which `hpcml launch slurm`'s script leaves out
    when it requeues the job. 0: never."""
    watchdog_s: float | None = Field(None, ge=0, le=SECONDS_MAX)
    """A rank without progress for this long ends the job naming the stuck rank and step;
    null means 0.9 x parallel.timeout_s (so it speaks before the collective times out),
    0 turns it off."""
    preempt_check_every: int | None = Field(None, gt=0)
    """Steps between the ranks' agreement on a preemption signal (and, with several processes,
    on Ctrl-C), one collective each; null means by `stop_check_s`. Keep K steps well under the
    scheduler's warning time (SLURM --signal lead) so the save still fits."""
    stop_check_s: float | None = Field(5.0, gt=0, le=SECONDS_MAX)
    """With several processes, a preemption or Ctrl-C is agreed within about this many seconds,
    whatever train.log_every is: the log flush (its one collective carries the stop flags) also
    runs after this many seconds' worth of steps, counted from the step time measured at the
    previous flush. null: only at the log_every flushes. `launch slurm` refuses a --signal-lead
    shorter than this plus the measured save time."""
    checkpoint_timeout_s: float | None = Field(None, ge=0, le=SECONDS_MAX)  # [fault] issue 11
    """A checkpoint phase (write, fsync, manifest, rename; read, at a resume or rollback) that
    runs this long ends the job naming the rank and the phase (a hung filesystem); 0 turns it
    off. null: from the bytes this rank writes or reads, 120 s plus 20 times their time at the
    write bandwidth the previous save measured (100 MB/s before one has)."""
    checkpoint_verify: Literal["full", "size", "none"] = "full"  # [fault] issue 11
    """How a resume checks the checkpoint it loads, each file once on one rank: full (sha256,
    hashed by the writing ranks at save), size (sizes only) or none (the manifest only)."""
    preempt_grace_s: float = Field(20.0, ge=0, le=SECONDS_MAX)  # [fault] issue 11
    """After a preemption signal, a checkpoint still being written this long ends the process
    (exit 1, the newest complete checkpoint kept) before the scheduler's SIGKILL (SLURM's
    KillWait and Kubernetes' grace period default to 30 s); 0 waits for the save."""
    preempt_notice: Literal["none", "aws", "gcp", "azure"] = "none"  # [fault] issue 11
    """Also poll this cloud's instance-metadata endpoint for a spot/preemption notice and treat
    one like a preemption signal (hpcml.train.fault.notice)."""
    preempt_notice_url: str | None = None  # [fault] issue 11
    """Base URL of the metadata endpoint; null means the provider's (169.254.169.254 or
    metadata.google.internal)."""
    preempt_notice_every_s: float = Field(5.0, gt=0, le=SECONDS_MAX)  # [fault] issue 11
    """How often to ask (AWS recommends every 5 s; it warns 2 minutes ahead, GCP about 30 s)."""
    preempt_signals: list[PreemptSignal] = Field(
        default_factory=lambda: list[PreemptSignal](["SIGTERM", "SIGUSR1"])
    )
    """Signals that ask for checkpoint-and-exit (exit code 75) at the next step boundary."""


class TrackingConfig(_Section):
    backend: Literal["none", "mlflow"] = "none"
    """`mlflow` logs params, metrics and artifacts of the run to MLflow, from rank 0 only
    (pip install 'hpcml[track]'); `none` turns tracking off."""
    uri: str | None = None
    """MLflow tracking URI; null means $MLFLOW_TRACKING_URI, else a SQLite store `mlruns.db` in
    the working folder."""
    experiment: str = "hpcml"
    """MLflow experiment the run is logged under; created when missing (a deleted one of that
    name is restored)."""
    run_name: str | None = None
    """MLflow name of a new run; null uses the run folder's name. A resumed run reopens its
    MLflow run and keeps its name."""
    tags: dict[str, str] = Field(default_factory=dict)
    """Free tags such as team, project, cost_center."""
    log_every: int = Field(10, gt=0)
    """One point per metric every N steps (the mean over those steps; lr its last value)."""
    flush_every_s: float = Field(5.0, ge=0, le=SECONDS_MAX)
    """Send queued points to the store at most this often, in one asynchronous batch (each
    store write costs ~10 ms of a background thread); the MLflow UI lags by up to this much."""


class ObserveConfig(_Section):
    metrics_port: int | None = Field(None, ge=0, le=65535)
    """Serve Prometheus `/metrics` from every rank on this port + the local rank (0: any free
    port); each rank writes its target to RUN_DIR/prometheus/rank-N.json (file_sd). null: off."""
    targets_dir: str | None = None
    """Folder for the ranks' file_sd target files, shared by runs (one Prometheus glob
    `DIR/*.json` finds them all: file_sd globs only the last path element); null:
    RUN_DIR/prometheus."""
    metrics_address: str = "0.0.0.0"
    """Address the `/metrics` endpoints bind to (127.0.0.1 keeps them on this machine)."""
    tls: TlsConfig | None = None
    """Serve the ranks' `/metrics` over HTTPS with this certificate (and, with `client_ca`,
    only to clients with a certificate that CA signed); the targets then say `https`. null:
    plain HTTP."""
    tracing: bool = False
    """OpenTelemetry spans for every step and its phases, evaluation and checkpoints, exported
    by OTLP/HTTP to $OTEL_EXPORTER_OTLP_ENDPOINT (pip install opentelemetry-exporter-otlp-proto-http);
    with no endpoint set, tracing stays off and one line says so."""
    job: str | None = None
    """The `job` label of the series; null: $SLURM_JOB_ID, else $HPCML_JOB, else the run
    folder's name."""
    strict_health: bool = False
    """Refuse to train on a GPU whose NVML pre-flight finds a problem (uncorrected ECC errors,
    pending memory repairs, slowdown at rest, a narrowed PCIe link, other processes on it);
    without it the problems are printed and the run goes on. On a run without a GPU, one line
    says there is nothing to check."""


class EncryptionConfig(_Section):
    """Encryption at rest (hpcml.crypt): AES-256-GCM over checkpoints and the exported weights."""

    enabled: bool = False
    """Encrypt what the run writes: every checkpoint file and `export/model.safetensors`
    (`model.json`, the manifest and the run records stay readable). The key comes from
    $HPCML_ENCRYPTION_KEY (64 hex digits), `key_file` or $HPCML_ENCRYPTION_KEY_FILE; resuming
    an encrypted checkpoint needs the same key whether or not this is set."""
    key_file: str | None = None
    """A file holding the key (64 hex digits, base64 or 32 raw bytes), outside the run folder;
    null: from the environment."""


class DpSgdConfig(_Section):
    """DP-SGD (Abadi et al. 2016) with Opacus: each sample's gradient clipped to
    `max_grad_norm`, Gaussian noise of `noise_multiplier` x `max_grad_norm` added to their sum."""

    noise_multiplier: float | None = Field(None, ge=0)
    """The noise's standard deviation over max_grad_norm; null: the smallest that keeps the
    whole run (train.max_steps) within `target_epsilon`. Give one of the two."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Each sample's gradient is scaled down to at most this L2 norm before the sum."""
    target_epsilon: float | None = Field(None, gt=0)
    """The privacy budget the run must stay within at `delta`, from which the noise is chosen."""
    delta: float = Field(1e-5, gt=0, lt=1)
    """The delta of (epsilon, delta)-differential privacy; below 1 / training samples."""

    @model_validator(mode="after")
    def _one_of(self) -> DpSgdConfig:
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ValueError("give exactly one of noise_multiplier and target_epsilon")
        return self


class PrivacyConfig(_Section):
    """Differential privacy of training (hpcml.train.privacy)."""

    dp_sgd: DpSgdConfig | None = None
    """Train with DP-SGD (Opacus): the privacy spent (epsilon) is in every step record, the
    summary and MLflow. Data parallel only (parallel.strategy ddp, tp 1, pp 1), fp32 or tf32,
    no gradient accumulation, no optim.grad_clip, no mixup or cutmix, a model without BatchNorm;
    anything else is refused before training starts. null: off."""


def check_ac_policy(value: str) -> str:
    """train.activation_checkpointing: a recomputation policy hpcml trains with."""
    if value == "attention-scores":
        raise ValueError(
            "attention-scores recomputes the s x s scores that only eager attention keeps, and "
            "the zoo's attention is fused (SDPA); use op, layer:K or full"
        )
    k = value.partition(":")[2] if value.startswith("layer:") else None
    if value in ("none", "full", "op", "selective") or (k and k.isdigit() and int(k) > 0):
        return value
    raise ValueError("use none, full, op, layer:K (K at least 1) or selective")
