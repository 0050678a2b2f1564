"""Training metrics in Prometheus: every rank serves `/metrics` (prometheus-client) and writes a
Prometheus `file_sd` target file, so a Prometheus that reads `RUN_DIR/prometheus/*.json` finds
all ranks without configuration (`observe/prometheus.yaml` is such a configuration).

Every series carries `job`, `run`, `rank` and `host` labels, so a query joins a rank's host and
GPU readings to the job and step it belongs to (scrape with `honor_labels: true`: the `job`
label is hpcml's job, e.g. the SLURM job id, not the scrape job's name). Values are updated at
the log flush (`train.log_every`), never per step: the hot path does not touch them.

The GPU series come from NVML (`nvidia-ml-py`) when a CUDA device is in use; they carry `gpu`
(the index) and `uuid`. Not verified on a GPU yet: this machine has none.
"""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hpcml.errors import ConfigError
from hpcml.observe.targets import write_target

STEP_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LABELS = ("job", "run", "rank", "host")


def safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", text)[:100]


def default_job(run_dir: Path) -> str:
    """The scheduler's job id where there is one, else the run folder's name."""
    return os.environ.get("SLURM_JOB_ID") or os.environ.get("HPCML_JOB") or run_dir.name


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
    ) -> None:
        try:
            from prometheus_client import CollectorRegistry, Histogram, start_http_server
            from prometheus_client.process_collector import ProcessCollector
        except ImportError:
            raise ConfigError(
                "observe.metrics_port needs prometheus-client; install it with "
                "pip install 'hpcml[observe]' or set observe.metrics_port to null."
            ) from None
        self.values: dict[str, float] = {"last_checkpoint": time.time()}
        """Gauges by key of GAUGES; a run counts as checkpointed at its start."""
        self.events: dict[str, float] = {}
        self.stragglers: dict[str, float] = {}
        self.host = socket.gethostname()
        self.label_values = [job or default_job(run_dir), run_dir.name, str(rank), self.host]
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # RSS, CPU seconds, open files of this rank
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
        self.gpu = _gpu_reader(gpu_index)
        want = port + local_rank if port else 0
        try:
            self.server, self.thread = start_http_server(want, address, registry=self.registry)
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
        else:  # shared by runs: the name says whose it is
            job_name, run_name = (safe_name(v) for v in self.label_values[:2])
            self.target_file = targets_dir / f"{job_name}-{run_name}-rank-{rank}.json"
        try:
            self._write_target()
        except OSError as exc:
            self.server.shutdown()
            self.server.server_close()
            raise ConfigError(
                f"rank {rank} cannot write its Prometheus target {str(self.target_file)!r} "
                f"({exc.strerror}); set observe.targets_dir to a folder it can write."
            ) from None

    def _write_target(self) -> None:
        job, run, rank, host = self.label_values
        labels = {"job": job, "run": run, "rank": rank, "host": host, "role": "train"}
        write_target(self.target_file, self.address, self.port, labels)

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
            for key in ("step", "loss", "lr", "samples_per_s", "tokens_per_s", "mfu"):
                if last.get(key) is not None:
                    self.values[key] = float(last[key])
        self.values["last_flush"] = time.time()
        self.events = {k: float(v) for k, v in fault_counts.items()}
        self.stragglers = {str(r): float(n) for r, n in (stragglers or {}).items()}

    def checkpointed(self) -> None:
        self.values["last_checkpoint"] = time.time()

    def close(self, finished: bool) -> None:
        """Stop serving. A finished run removes its target (Prometheus stops scraping it); a
        failed one leaves it, so `up == 0` tells an alert the job died."""
        self.server.shutdown()
        self.server.server_close()
        if finished:
            self.target_file.unlink(missing_ok=True)


GAUGES = {
    "step": ("hpcml_train_step", "Last optimizer step flushed."),
    "loss": ("hpcml_train_loss", "Training loss of the last flushed step (mean over ranks)."),
    "lr": ("hpcml_train_learning_rate", "Learning rate of the last flushed step."),
    "samples_per_s": ("hpcml_train_samples_per_second", "Samples/s of the last flushed step."),
    "tokens_per_s": ("hpcml_train_tokens_per_second", "Tokens/s of the last flushed step."),
    "mfu": ("hpcml_train_mfu_ratio", "Model FLOPs utilization of the last flushed step (0..1)."),
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
        if ex.gpu is not None:
            yield from ex.gpu(lv)


def _gpu_reader(index: int | None) -> Callable[[list[str]], Iterator[Any]] | None:
    """NVML readings of the rank's GPU, or None without a GPU or without nvidia-ml-py."""
    if index is None:
        return None
    try:
        import pynvml
    except ImportError:
        return None
    from hpcml.observe.gpu_health import clock_event_mask, cuda_uuid

    try:
        pynvml.nvmlInit()
        # By UUID: NVML numbers all GPUs, CUDA only the visible ones (CUDA_VISIBLE_DEVICES).
        uuid = cuda_uuid(index)
        if uuid is None:
            return None
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
    except (pynvml.NVMLError, RuntimeError, AssertionError):
        return None

    def read(lv: list[str]) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        labels = (*LABELS, "gpu", "uuid")
        values = [*lv, str(index), uuid]
        readings = {
            "hpcml_gpu_utilization_ratio": lambda: pynvml.nvmlDeviceGetUtilizationRates(
                handle
            ).gpu
            / 100,
            "hpcml_gpu_memory_used_bytes": lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).used,
            "hpcml_gpu_memory_total_bytes": lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).total,
            "hpcml_gpu_temperature_celsius": lambda: pynvml.nvmlDeviceGetTemperature(
                handle, pynvml.NVML_TEMPERATURE_GPU
            ),
            "hpcml_gpu_power_watts": lambda: pynvml.nvmlDeviceGetPowerUsage(handle) / 1000,
            "hpcml_gpu_sm_clock_hertz": lambda: pynvml.nvmlDeviceGetClockInfo(
                handle, pynvml.NVML_CLOCK_SM
            )
            * 1e6,
            "hpcml_gpu_throttle_reasons": lambda: clock_event_mask(pynvml, handle),
        }
        for name, read_one in readings.items():
            try:
                value = float(read_one())
            except pynvml.NVMLError:
                continue  # not supported on this device
            family = GaugeMetricFamily(name, f"NVML reading {name} of the rank's GPU.", labels=labels)
            family.add_metric(values, value)
            yield family

    return read
