"""This host's CPU, memory, disk and network counters as Prometheus series (psutil), read at
scrape time. One rank per host serves them (local rank 0): the others would repeat the same
numbers under their own rank labels."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


class HostCollector:
    def __init__(self, label_names: tuple[str, ...], values: list[str]) -> None:
        self.names, self.values = label_names, values

    def collect(self) -> Iterator[Any]:
        import psutil
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        names, vals = self.names, self.values
        cpu = CounterMetricFamily(
            "hpcml_host_cpu_seconds", "CPU seconds of this host by mode (all cores).",
            labels=(*names, "mode"),
        )  # fmt: skip
        for mode, seconds in psutil.cpu_times()._asdict().items():
            cpu.add_metric([*vals, mode], float(seconds))
        yield cpu
        cores = GaugeMetricFamily("hpcml_host_cpu_count", "Logical CPUs of this host.", labels=names)
        cores.add_metric(vals, float(psutil.cpu_count() or 0))
        yield cores
        mem = GaugeMetricFamily(
            "hpcml_host_memory_available_bytes", "Memory available to new processes.", labels=names
        )
        mem.add_metric(vals, float(psutil.virtual_memory().available))
        yield mem
        disk = psutil.disk_io_counters()
        net = psutil.net_io_counters()
        for name, doc, value in (
            ("hpcml_host_disk_read_bytes", "Bytes read from this host's disks.",
             disk.read_bytes if disk else None),
            ("hpcml_host_disk_written_bytes", "Bytes written to this host's disks.",
             disk.write_bytes if disk else None),
            ("hpcml_host_network_received_bytes", "Bytes received on this host's interfaces.",
             net.bytes_recv),
            ("hpcml_host_network_sent_bytes", "Bytes sent on this host's interfaces.", net.bytes_sent),
        ):  # fmt: skip
            if value is not None:  # no disk statistics in some containers
                family = CounterMetricFamily(name, doc, labels=names)
                family.add_metric(vals, float(value))
                yield family
