"""NVML readings of a rank's GPU as Prometheus series (nvidia-ml-py), read at scrape time.

Each series carries the rank's labels plus `gpu` (CUDA's index in the process) and `uuid`
(NVML's GPU-... id: what dcgm-exporter's `UUID` label holds, so `hpcml_rank_info` joins its
series to a job). A reading the device does not support (no ECC on consumer GPUs, no retired
pages on Ampere and later) is left out rather than reported as 0.

The NVML module is a parameter: tests pass a fake one, because NVML cannot run without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from hpcml.observe.gpu_health import clock_event_mask, reason_names

Reader = Callable[[tuple[str, ...], list[str]], Iterator[Any]]


def open_nvml(nv: Any = None) -> Any | None:
    """`nv`, or pynvml initialised; None without nvidia-ml-py or a driver."""
    if nv is not None:
        return nv
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no library, no driver, no GPU: no GPU series
        return None
    return pynvml


def gpu_reader(index: int | None, uuid: str | None, nv: Any = None) -> tuple[Reader, str] | None:
    """A function yielding the metric families of GPU `uuid`, and its uuid; None when there is
    no GPU to read (a CPU rank, no NVML, an unknown uuid)."""
    if index is None or uuid is None:
        return None
    nv = open_nvml(nv)
    if nv is None:
        return None
    try:
        handle = nv.nvmlDeviceGetHandleByUUID(uuid)
    except nv.NVMLError:
        return None

    def read(label_names: tuple[str, ...], values: list[str]) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        names, vals = (*label_names, "gpu", "uuid"), [*values, str(index), uuid]

        def maybe(fn: Callable[[], Any]) -> Any:
            try:
                return fn()
            except nv.NVMLError:  # not supported on this device
                return None

        for name, doc, get in _gauges(nv, handle):
            value = maybe(get)
            if value is not None:
                family = GaugeMetricFamily(name, doc, labels=names)
                family.add_metric(vals, float(value))
                yield family
        ecc = CounterMetricFamily(
            "hpcml_gpu_ecc_errors",
            "ECC errors since the driver last loaded (volatile), by kind.",
            labels=(*names, "kind"),
        )
        for kind, code in (("corrected", "CORRECTED"), ("uncorrected", "UNCORRECTED")):
            got = maybe(lambda c=code: nv.nvmlDeviceGetTotalEccErrors(  # type: ignore[misc]
                handle, getattr(nv, f"NVML_MEMORY_ERROR_TYPE_{c}"), nv.NVML_VOLATILE_ECC))
            if got is not None:
                ecc.add_metric([*vals, kind], float(got))
        yield ecc
        retired = GaugeMetricFamily(
            "hpcml_gpu_retired_pages",
            "Device memory pages retired by the driver, by cause (pre-Ampere GPUs).",
            labels=(*names, "cause"),
        )
        for cause, code in (("single_bit", "MULTIPLE_SINGLE_BIT_ECC_ERRORS"),
                            ("double_bit", "DOUBLE_BIT_ECC_ERROR")):  # fmt: skip
            pages = maybe(lambda c=code: nv.nvmlDeviceGetRetiredPages(  # type: ignore[misc]
                handle, getattr(nv, f"NVML_PAGE_RETIREMENT_CAUSE_{c}")))
            if pages is not None:
                retired.add_metric([*vals, cause], float(len(pages)))
        yield retired
        mask = maybe(lambda: clock_event_mask(nv, handle))
        if mask is not None:
            active = set(reason_names(nv, mask))
            family = GaugeMetricFamily(
                "hpcml_gpu_clock_event_active",
                "1 while NVML reports this clock event (throttle) reason, else 0.",
                labels=(*names, "reason"),
            )
            for reason in reason_names(nv, -1):  # every reason this NVML knows
                family.add_metric([*vals, reason], float(reason in active))
            yield family

    return read, uuid


def _gauges(nv: Any, handle: Any) -> list[tuple[str, str, Callable[[], Any]]]:
    def remap_pending() -> int:
        return int(bool(nv.nvmlDeviceGetRemappedRows(handle)[2]))

    return [
        ("hpcml_gpu_utilization_ratio", "Share of the last sample period a kernel ran (0..1).",
         lambda: nv.nvmlDeviceGetUtilizationRates(handle).gpu / 100),
        ("hpcml_gpu_memory_used_bytes", "Device memory in use.",
         lambda: nv.nvmlDeviceGetMemoryInfo(handle).used),
        ("hpcml_gpu_memory_total_bytes", "Device memory in all.",
         lambda: nv.nvmlDeviceGetMemoryInfo(handle).total),
        ("hpcml_gpu_temperature_celsius", "GPU core temperature.",
         lambda: nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU)),
        ("hpcml_gpu_power_watts", "Power draw.", lambda: nv.nvmlDeviceGetPowerUsage(handle) / 1000),
        ("hpcml_gpu_sm_clock_hertz", "SM clock.",
         lambda: nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_SM) * 1e6),
        ("hpcml_gpu_retired_pages_pending", "1 when retired pages wait for a GPU reset.",
         lambda: int(bool(nv.nvmlDeviceGetRetiredPagesPendingStatus(handle)))),
        ("hpcml_gpu_row_remap_pending", "1 when remapped rows wait for a GPU reset (A100, H100).",
         remap_pending),
    ]  # fmt: skip
