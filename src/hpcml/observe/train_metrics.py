"""Training metrics in Prometheus: every rank serves `/metrics` (prometheus-client) and writes a
Prometheus `file_sd` target file, so a Prometheus that reads `RUN_DIR/prometheus/*.json` finds
all ranks without configuration (`observe/prometheus.yaml` is such a configuration).

Every series carries `job`, `run`, `run_id`, `rank` and `host` labels, so a query joins a rank's
host and GPU readings to the job and step it belongs to (scrape with `honor_labels: true`: the `job`
label is hpcml's job, e.g. the SLURM job id, not the scrape job's name). `run_id` tells apart
runs whose folders share a name (`exp1/run`, `exp2/run`): it is a hash of the run folder's
absolute path, so a resumed run keeps it. Each endpoint serves `/metrics` and its own
`/metrics/RUN_ID/rank-N`, which its target file names, and answers 404 to any other
`/metrics/...`: a scrape meant for a killed run whose port another process took fails (`up` 0)
instead of reporting the newcomer under the dead run's labels. Values are updated at
the log flush (`train.log_every`), never per step: the hot path does not touch them.

The GPU series come from NVML (`nvidia-ml-py`, hpcml.observe.nvml_metrics) when a CUDA device
is in use; they carry `gpu` (the index) and `uuid`. Checked through a fake NVML module; not
verified on a GPU yet. Local rank 0 also serves its host's CPU, memory, disk and network
counters (hpcml.observe.host_metrics). With `observe.tls` the endpoints speak HTTPS (and, with
a client CA, only to clients holding a certificate it signed); their targets say `https`.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hpcml.config_sections import TlsConfig
from hpcml.errors import ConfigError
from hpcml.observe.host_metrics import HostCollector
from hpcml.observe.nvml_metrics import Reader, gpu_reader
from hpcml.observe.targets import prune_dead, write_target
from hpcml.observe.tls import server_context

STEP_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
CHECKPOINT_BUCKETS_S = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
LABELS = ("job", "run", "run_id", "rank", "host")


def safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", text)[:100]


def default_job(run_dir: Path) -> str:
    """The scheduler's job id where there is one, else the run folder's name."""
    return os.environ.get("SLURM_JOB_ID") or os.environ.get("HPCML_JOB") or run_dir.name


def run_id_of(run_dir: Path) -> str:
    """The same on every rank and host of a run (a shared folder has one absolute path), and
    on its resumes; different for two folders of the same name."""
    return hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:12]


class TrainExporter:
    """One rank's `/metrics` endpoint and target file. `update` is called at each log flush."""

    def __init__(
        self,
        port: int,
        address: str,
        run_dir: Path,
        rank: int,
        local_rank: int,
        job: str | None = None,
        gpu_index: int | None = None,
        targets_dir: Path | None = None,
        nvml: Any = None,
        gpu_uuid: str | None = None,
        tls: TlsConfig | None = None,
    ) -> None:
        """`nvml`, `gpu_uuid`: an NVML module and the GPU's uuid (tests pass a fake module);
        by default nvidia-ml-py and the uuid CUDA reports for `gpu_index`. `tls`
        (`observe.tls`): serve HTTPS with that certificate."""
        try:
            import psutil  # noqa: F401  (host readings, target owners)
            from prometheus_client import CollectorRegistry, Histogram
            from prometheus_client.process_collector import ProcessCollector
        except ImportError:
            raise ConfigError(
                "observe.metrics_port needs prometheus-client and psutil; install them with "
                "pip install 'hpcml[observe]' or set observe.metrics_port to null."
            ) from None
        self.values: dict[str, float] = {"last_checkpoint": time.time()}
        """Gauges by key of GAUGES; a run counts as checkpointed at its start."""
        self.last_flush = time.time()  # the first flush interval counts from the start
        self.eval: dict[str, float] = {}
        self.history: dict[str, float] = {}
        """Counts over the run's whole life (resumes, preemptions, elastic restarts)."""
        self.events: dict[str, float] = {}
        self.stragglers: dict[str, float] = {}
        self.host = socket.gethostname()
        self.run_id = run_id_of(run_dir)
        self.label_values = [
            job or default_job(run_dir), run_dir.name, self.run_id, str(rank), self.host
        ]
        self.registry = CollectorRegistry()
        # RSS, CPU seconds, open files of this rank, with the rank's labels (not only the
        # target's), so they stay this run's whichever target scraped them.
        self.registry.register(_Labelled(ProcessCollector(registry=None), self.label_values))
        self.registry.register(_Snapshot(self))
        self.step_s = Histogram(
            "hpcml_train_step_seconds",
            "Per optimizer step on this rank: wall time of the step.",
            LABELS,
            buckets=STEP_BUCKETS_S,
            registry=self.registry,
        ).labels(*self.label_values)
        self.data_wait_s = Histogram(
            "hpcml_train_data_wait_seconds",
            "Per optimizer step on this rank: time spent waiting for the next batch.",
            LABELS,
            buckets=STEP_BUCKETS_S,
            registry=self.registry,
        ).labels(*self.label_values)
        self.checkpoint_s = Histogram(
            "hpcml_train_checkpoint_seconds",
            "Per checkpoint on this rank: wall time of a save (until it returns to training; "
            "an asynchronous save finishes later) or of the load at a resume.",
            (*LABELS, "op"),
            buckets=CHECKPOINT_BUCKETS_S,
            registry=self.registry,
        )
        if gpu_index is not None and gpu_uuid is None and nvml is None:
            gpu_uuid = _cuda_uuid(gpu_index)
        gpu = gpu_reader(gpu_index, gpu_uuid, nvml)
        self.gpu: Reader | None = None if gpu is None else gpu[0]
        self.gpu_uuid = "" if gpu is None else gpu[1]
        if local_rank == 0:  # one rank per host reads the host
            self.registry.register(HostCollector(LABELS, self.label_values))
        self.metrics_path = f"/metrics/{self.run_id}/rank-{rank}"
        want = port + local_rank if port else 0
        context = None if tls is None else server_context(tls, "observe.tls")
        self.scheme = "http" if tls is None else "https"
        try:
            self.server = serve_metrics(self.registry, address, want, self.metrics_path, context)
        except OSError as exc:
            raise ConfigError(
                f"observe.metrics_port: rank {rank} cannot listen on port {want} ({exc.strerror}); "
                "choose another port, or 0 for any free one."
            ) from None
        self.port = int(self.server.server_address[1])
        # What Prometheus connects to: the bound address, or this host's name when bound to all.
        self.address = self.host if address in ("", "0.0.0.0", "::") else address
        if targets_dir is None:
            self.target_file = run_dir / "prometheus" / f"rank-{rank}.json"
        else:  # shared by runs: the name says whose it is, the run id tells same names apart
            job_name, run_name = (safe_name(v) for v in self.label_values[:2])
            name = f"{job_name}-{run_name}-{self.run_id}-rank-{rank}.json"
            self.target_file = targets_dir / name
        try:
            prune_dead(self.target_file.parent)  # targets of processes killed with SIGKILL
            self._write_target()
        except OSError as exc:
            self.server.shutdown()
            self.server.server_close()
            raise ConfigError(
                f"rank {rank} cannot write its Prometheus target {str(self.target_file)!r} "
                f"({exc.strerror}); set observe.targets_dir to a folder it can write."
            ) from None

    def _write_target(self) -> None:
        labels = dict(zip(LABELS, self.label_values, strict=True))
        labels["role"] = "train"
        if self.scheme == "https":  # file_sd's way to say how Prometheus must connect
            labels["__scheme__"] = "https"
        write_target(self.target_file, self.address, self.port, labels, self.metrics_path)

    def update(
        self,
        records: list[dict[str, Any]],
        fault_counts: dict[str, int],
        stragglers: dict[int, int] | None = None,
    ) -> None:
        """The records of one log flush (this rank's times, the ranks' mean loss), the fault
        guard's counts and how often each rank was flagged as a straggler."""
        for rec in records:
            self.step_s.observe(rec["step_time_s"])
            self.data_wait_s.observe(rec["data_wait_s"])
        if records:
            last = records[-1]
            for key in ("step", "loss", "lr", "samples_per_s", "tokens_per_s", "mfu", "grad_norm"):
                if last.get(key) is not None:
                    self.values[key] = float(last[key])
        now = time.time()
        self.values["flush_interval"] = now - self.last_flush
        self.values["last_flush"] = self.last_flush = now
        self.events = {k: float(v) for k, v in fault_counts.items()}
        self.stragglers = {str(r): float(n) for r, n in (stragglers or {}).items()}

    def checkpointed(self, save_s: float | None = None) -> None:
        self.values["last_checkpoint"] = time.time()
        if save_s is not None:
            self.checkpoint_s.labels(*self.label_values, "save").observe(save_s)

    def started(self, load_s: float | None, history: dict[str, int]) -> None:
        """At the start: the resume's checkpoint load time, and the run's `history` counts
        (`resumes`, `preemptions`, `elastic_restarts`) from its run log and launcher."""
        if load_s is not None:
            self.checkpoint_s.labels(*self.label_values, "load").observe(load_s)
        self.history = {k: float(v) for k, v in history.items()}

    def evaluated(self, metrics: dict[str, Any]) -> None:
        """The last evaluation's numbers (loss, accuracy, eval sets' scores)."""
        self.eval = {
            str(k): float(v) for k, v in metrics.items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        }  # fmt: skip

    def close(self) -> None:
        """Stop serving and remove the target, on every way out the process sees (finish,
        preemption, Ctrl-C, failure): Prometheus stops scraping a run that is gone. Only a
        process killed with SIGKILL leaves its file, which the next start prunes."""
        self.target_file.unlink(missing_ok=True)
        self.server.shutdown()
        self.server.server_close()


def serve_metrics(
    registry: Any, address: str, port: int, own_path: str, context: ssl.SSLContext | None = None
) -> Any:
    """prometheus-client's WSGI app on a daemon thread, answering 404 to `/metrics/...` paths
    other than `own_path`; the server (`server_address`, `shutdown`, `server_close`). With an
    SSL `context`, HTTPS: each connection's handshake runs in its own handler thread (not in
    the accepting one, where a client that never finishes it would stall every scrape)."""
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from prometheus_client.exposition import ThreadingWSGIServer, make_wsgi_app

    metrics = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        path = environ.get("PATH_INFO", "")
        if path.startswith("/metrics/") and path != own_path:
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [f"this endpoint serves {own_path}, not {path}\n".encode()]
        return metrics(environ, start_response)

    family, _, _, _, sockaddr = socket.getaddrinfo(
        address, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]

    class Server(ThreadingWSGIServer):
        address_family = family

        def handle_error(self, request: Any, client_address: Any) -> None:
            # A client that fails the handshake (no TLS, an unknown CA, no client certificate)
            # is its own problem: no traceback on the training rank's stderr for it.
            if not isinstance(sys.exc_info()[1], ssl.SSLError | ConnectionError):
                super().handle_error(request, client_address)

    class Quiet(WSGIRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass

    server = make_server(str(sockaddr[0]), port, app, Server, handler_class=Quiet)
    if context is not None:
        server.socket = context.wrap_socket(
            server.socket, server_side=True, do_handshake_on_connect=False
        )
    threading.Thread(target=server.serve_forever, name="hpcml-metrics", daemon=True).start()
    return server


class _Labelled:
    """Another collector's series with this rank's labels added."""

    def __init__(self, inner: Any, values: list[str]) -> None:
        self.inner, self.labels = inner, dict(zip(LABELS, values, strict=True))

    def collect(self) -> Iterator[Any]:
        for family in self.inner.collect():
            family.samples = [s._replace(labels={**s.labels, **self.labels}) for s in family.samples]
            yield family


GAUGES = {
    "step": ("hpcml_train_step", "Last optimizer step flushed."),
    "loss": ("hpcml_train_loss", "Training loss of the last flushed step (mean over ranks)."),
    "lr": ("hpcml_train_learning_rate", "Learning rate of the last flushed step."),
    "samples_per_s": ("hpcml_train_samples_per_second", "Samples/s of the last flushed step."),
    "tokens_per_s": ("hpcml_train_tokens_per_second", "Tokens/s of the last flushed step."),
    "mfu": ("hpcml_train_mfu_ratio", "Model FLOPs utilization of the last flushed step (0..1)."),
    "grad_norm": (
        "hpcml_train_grad_norm",
        "Global gradient norm of the last flushed step (before clipping; absent under fp16 "
        "loss scaling).",
    ),
    "flush_interval": (
        "hpcml_train_flush_interval_seconds",
        "Seconds between the last two log flushes (the first: since the rank started); the "
        "stall alert scales with it.",
    ),
    "last_flush": (
        "hpcml_train_last_flush_timestamp_seconds",
        "Unix time of the last log flush; an alert on time() minus it finds a stalled job.",
    ),
    "last_checkpoint": (
        "hpcml_train_last_checkpoint_timestamp_seconds",
        "Unix time of the last checkpoint this run saved (its start before the first).",
    ),
}


class _Snapshot:
    """Gauges and fault counters from the exporter's last update, read at scrape time."""

    def __init__(self, exporter: TrainExporter) -> None:
        self.exporter = exporter

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        ex, lv = self.exporter, self.exporter.label_values
        for key, (name, doc) in GAUGES.items():
            if key in ex.values:
                family = GaugeMetricFamily(name, doc, labels=LABELS)
                family.add_metric(lv, ex.values[key])
                yield family
        events = CounterMetricFamily(
            "hpcml_train_fault_events",
            "Fault events handled by this run (nonfinite_steps, spike_steps, skipped_steps, "
            "rollbacks, dropped_batches, ...).",
            labels=(*LABELS, "event"),
        )
        for event, count in sorted(ex.events.items()):
            events.add_metric([*lv, event], count)
        yield events
        flagged = CounterMetricFamily(
            "hpcml_train_straggler_flags",
            "Times each rank's step took more than fault.straggler_factor x the median.",
            labels=(*LABELS, "straggler_rank"),
        )
        for slow_rank, count in sorted(ex.stragglers.items()):
            flagged.add_metric([*lv, slow_rank], count)
        yield flagged
        history = CounterMetricFamily(
            "hpcml_train_restarts",
            "Times this run restarted: kind=resume (a new process resumed its folder), "
            "preemption (it stopped for a preemption and was resumed), elastic (torchrun "
            "restarted its workers in this launch).",
            labels=(*LABELS, "kind"),
        )
        for kind, count in sorted(ex.history.items()):
            history.add_metric([*lv, kind], count)
        yield history
        evals = GaugeMetricFamily(
            "hpcml_train_eval_metric",
            "The last evaluation's numbers by name (val_loss, val_accuracy, eval sets' scores).",
            labels=(*LABELS, "metric"),
        )
        for metric, value in sorted(ex.eval.items()):
            evals.add_metric([*lv, metric], value)
        yield evals
        info = GaugeMetricFamily(
            "hpcml_rank_info",
            "1 for each rank: its labels and its GPU's uuid (empty without one), so "
            "dcgm-exporter's series join a job with `on (UUID)` after label_replace.",
            labels=(*LABELS, "gpu_uuid"),
        )
        info.add_metric([*lv, ex.gpu_uuid], 1.0)
        yield info
        if ex.gpu is not None:
            yield from ex.gpu(LABELS, lv)


def _cuda_uuid(index: int) -> str | None:
    """NVML's uuid of CUDA device `index`; None when CUDA cannot say (no GPU, no driver)."""
    from hpcml.observe.gpu_health import cuda_uuid

    try:
        return cuda_uuid(index)
    except (RuntimeError, AssertionError):
        return None
