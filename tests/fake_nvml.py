"""A stand-in for nvidia-ml-py's `pynvml` module with the readings of one GPU, for the NVML
series of hpcml.observe.nvml_metrics (tests/unit/test_observe_exporter.py, and the GPU panels
in tests/integration/test_observe_prometheus.py)."""

from __future__ import annotations


class FakeNvml:
    """The part of nvidia-ml-py the exporter calls, with fixed readings of one GPU: NVML
    cannot run without a GPU, so this is the one place a stand-in is right. Constants and
    reason bits are nvidia-ml-py's own."""

    def __init__(self) -> None:
        import pynvml

        self.NVMLError = pynvml.NVMLError
        for name in dir(pynvml):
            if name.startswith(("NVML_", "nvmlClocksEventReason", "nvmlClocksThrottleReason")):
                setattr(self, name, getattr(pynvml, name))
        self.mask = pynvml.nvmlClocksEventReasonHwThermalSlowdown | pynvml.nvmlClocksEventReasonSwPowerCap

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:  # noqa: N802
        if uuid != "GPU-fake":
            raise self.NVMLError(13)
        return "handle"

    def nvmlDeviceGetUtilizationRates(self, h: str) -> object:  # noqa: N802
        return type("U", (), {"gpu": 87})()

    def nvmlDeviceGetMemoryInfo(self, h: str) -> object:  # noqa: N802
        return type("M", (), {"used": 3 * 2**30, "total": 80 * 2**30})()

    def nvmlDeviceGetTemperature(self, h: str, sensor: int) -> int:  # noqa: N802
        return 71

    def nvmlDeviceGetPowerUsage(self, h: str) -> int:  # noqa: N802
        return 312_500  # milliwatts

    def nvmlDeviceGetClockInfo(self, h: str, clock: int) -> int:  # noqa: N802
        return 1410  # MHz

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: str) -> int:  # noqa: N802
        return self.mask

    def nvmlDeviceGetTotalEccErrors(self, h: str, kind: int, counter: int) -> int:  # noqa: N802
        assert counter == self.NVML_VOLATILE_ECC
        return {self.NVML_MEMORY_ERROR_TYPE_CORRECTED: 12, self.NVML_MEMORY_ERROR_TYPE_UNCORRECTED: 2}[kind]

    def nvmlDeviceGetRetiredPages(self, h: str, cause: int) -> list[int]:  # noqa: N802
        return [0x1000] * (3 if cause == self.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR else 1)

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h: str) -> int:  # noqa: N802
        return 1

    def nvmlDeviceGetRemappedRows(self, h: str) -> tuple[int, int, int, int]:  # noqa: N802
        raise self.NVMLError(3)  # NOT_SUPPORTED: a pre-Ampere GPU has no row remapping
