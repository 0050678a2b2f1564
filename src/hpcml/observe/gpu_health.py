"""GPU health pre-flight: NVML checks before a run uses a GPU, one sentence per problem.

Checked per device (nvidia-ml-py, the NVML bindings NVIDIA maintains):

- uncorrected ECC errors since the last reset (volatile count);
- retired pages waiting for a reset (pre-Ampere) and row remapping pending or failed (A100,
  H100: the memory has errors the driver can only repair at a GPU reset, or not at all);
- clock event reasons that mean a slowed GPU at rest: hardware slowdown, hardware or software
  thermal slowdown, power brake (idle, application clocks and the software power cap are
  normal and not reported);
- a PCIe link narrower than the device's maximum (the link *generation* drops at idle to save
  power, so a lower generation is not a problem before load);
- other processes holding the device (their PID and memory), which will contend for it.

`problems()` turns one reading into sentences and is the part tests check without a GPU;
`read_gpus()` takes the readings through NVML and is verified only where a GPU is present.
Hand-written because DCGM's diagnostics (`dcgmi diag`) need the DCGM service, which a training
job cannot assume, and NVML exposes the counters directly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

SLOWDOWN_REASONS = {
    "HwSlowdown": "hardware slowdown (power or thermal protection)",
    "HwThermalSlowdown": "hardware thermal slowdown",
    "SwThermalSlowdown": "software thermal slowdown",
    "HwPowerBrakeSlowdown": "power brake (external power supply signal)",
}


@dataclass
class GpuReading:
    index: int
    uuid: str
    name: str
    ecc_uncorrected: int | None = None
    retired_pages_pending: bool | None = None
    remap_pending: bool | None = None
    remap_failed: bool | None = None
    clock_reasons: list[str] = field(default_factory=list)
    """Names of the active clock event reasons (NVML's constants, without their prefix)."""
    pcie_width: int | None = None
    pcie_width_max: int | None = None
    other_processes: list[tuple[int, int]] = field(default_factory=list)
    """(pid, bytes of device memory) of compute processes other than this one."""


def problems(r: GpuReading) -> list[str]:
    """One sentence per problem found in a reading; [] when the device looks healthy."""
    where = f"GPU {r.index} ({r.name}, {r.uuid})"
    out = []
    if r.ecc_uncorrected:
        out.append(
            f"{where} has {r.ecc_uncorrected} uncorrected ECC error(s) since its last reset; "
            "drain the node and have the GPU reset or checked."
        )
    if r.retired_pages_pending or r.remap_pending:
        out.append(
            f"{where} has memory repairs pending that only a GPU reset applies; reset it "
            "(nvidia-smi -r) before training."
        )
    if r.remap_failed:
        out.append(f"{where} failed to remap a memory row; the GPU needs replacing.")
    for reason in r.clock_reasons:
        if reason in SLOWDOWN_REASONS:
            out.append(
                f"{where} is slowed down at rest: {SLOWDOWN_REASONS[reason]}; check its cooling "
                "and power before training."
            )
    if r.pcie_width and r.pcie_width_max and r.pcie_width < r.pcie_width_max:
        out.append(
            f"{where} runs its PCIe link at x{r.pcie_width} of x{r.pcie_width_max}; reseat the "
            "card or check the slot (host-device copies will be slower)."
        )
    for pid, used in r.other_processes:
        out.append(
            f"{where} is also used by process {pid} ({used / 2**20:.0f} MiB); stop it or pick "
            "another device."
        )
    return out


def _nvml() -> Any | None:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no library, no driver, no GPU: nothing to check
        return None
    return pynvml


def clock_event_mask(nv: Any, handle: Any) -> int:
    """The device's clock event (throttle) reason bits, by whichever name this NVML has."""
    get = (
        getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)
        or nv.nvmlDeviceGetCurrentClocksThrottleReasons
    )
    return int(get(handle))


def _clock_reasons(nv: Any, handle: Any) -> list[str]:
    return reason_names(nv, clock_event_mask(nv, handle))


def reason_names(nv: Any, mask: int) -> list[str]:
    """The clock event reasons set in `mask`, by NVML's constant names without the prefix
    (the catch-alls All, None and Unknown left out)."""
    names = []
    for attr in dir(nv):
        for prefix in ("nvmlClocksEventReason", "nvmlClocksThrottleReason"):
            if attr.startswith(prefix):
                bit = getattr(nv, attr)
                name = attr.removeprefix(prefix)
                skip = name in ("All", "None", "Unknown")
                if isinstance(bit, int) and bit and mask & bit == bit and not skip:
                    names.append(name)
    return sorted(set(names))


def _read(nv: Any, handle: Any) -> GpuReading:
    name = nv.nvmlDeviceGetName(handle)
    r = GpuReading(
        int(nv.nvmlDeviceGetIndex(handle)),
        str(nv.nvmlDeviceGetUUID(handle)),
        name.decode() if isinstance(name, bytes) else str(name),
    )

    def maybe(fn: Any, *args: Any) -> Any:
        try:
            return fn(handle, *args)
        except nv.NVMLError:  # not supported on this device (consumer GPUs: no ECC)
            return None

    r.ecc_uncorrected = maybe(
        nv.nvmlDeviceGetTotalEccErrors, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC
    )
    pending = maybe(nv.nvmlDeviceGetRetiredPagesPendingStatus)
    r.retired_pages_pending = None if pending is None else bool(pending)
    remap = maybe(nv.nvmlDeviceGetRemappedRows)
    if remap is not None:
        r.remap_pending, r.remap_failed = bool(remap[2]), bool(remap[3])
    r.clock_reasons = maybe(lambda h: _clock_reasons(nv, h)) or []
    r.pcie_width = maybe(nv.nvmlDeviceGetCurrPcieLinkWidth)
    r.pcie_width_max = maybe(nv.nvmlDeviceGetMaxPcieLinkWidth)
    procs = maybe(nv.nvmlDeviceGetComputeRunningProcesses) or []
    r.other_processes = [
        (int(p.pid), int(p.usedGpuMemory or 0)) for p in procs if int(p.pid) != os.getpid()
    ]
    return r


def read_gpus(uuids: list[str] | None = None) -> list[GpuReading] | None:
    """Readings of the devices with these UUIDs (CUDA's numbering differs from NVML's under
    CUDA_VISIBLE_DEVICES, a UUID does not), of all devices when None; None where NVML finds
    no GPU."""
    nv = _nvml()
    if nv is None:
        return None
    try:
        if uuids is None:
            handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
        else:
            handles = [nv.nvmlDeviceGetHandleByUUID(u) for u in uuids]
        return [_read(nv, h) for h in handles] or None
    finally:
        nv.nvmlShutdown()


def cuda_uuid(index: int) -> str | None:
    """NVML's UUID (GPU-...) of CUDA device `index` as this process numbers it."""
    import torch

    uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", "") or "")
    if not uuid:
        return None
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"


def preflight(device: Any) -> list[str] | None:
    """Problems of the CUDA device a rank trains on ([] healthy); None when it is not a GPU
    NVML can read (a CPU run, or no NVML)."""
    if getattr(device, "type", "") != "cuda":
        return None
    uuid = cuda_uuid(device.index or 0)
    readings = read_gpus([uuid]) if uuid else None
    if not readings:
        return None
    return problems(readings[0])
