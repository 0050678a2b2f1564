"""What the GPU did during each profiled step, read from the device events of the Chrome trace
torch.profiler exports (Kineto's format: `traceEvents` of phase `X`, times in microseconds).

Each profiled step's wall time (its `ProfilerStep#N` range on the training loop's thread) is
split, instant by instant, by what ran on the device then (kernels, copies and memsets, on any
stream):

- compute: a kernel other than a collective's was running;
- communication: only a collective's kernel was running (NCCL's, by name, or one Kineto tagged
  with the `Collective name` it copies from c10d's `record_param_comms`): communication that
  compute did not hide;
- memcpy: only copies or memsets were running;
- idle: nothing ran on the device, split by what the loop's thread was doing meanwhile: `data`
  while it waited for the next batch (`hpcml.data`), `host_overhead` otherwise (launching
  kernels, Python, the host side of the optimizer: the device starved by the host).

The five parts (compute, communication, memcpy, data, host overhead) add up to the step; idle is
data + host overhead. `communication_in_flight` is the time any collective kernel ran, hidden
or not. Kernels are placed where the device ran them, not where the host launched them: a host
running ahead of the device shows its steps full of the device's earlier work, which is what
the device was doing during that wall time.
"""

from __future__ import annotations

import statistics
from typing import Any

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
PARTS = ("compute", "communication", "memcpy", "data", "host_overhead")

Intervals = list[tuple[float, float]]


def union(intervals: Intervals) -> Intervals:
    out: Intervals = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        elif end > start:
            out.append((start, end))
    return out


def length(intervals: Intervals) -> float:
    return sum(end - start for start, end in intervals)


def intersect(a: Intervals, b: Intervals) -> Intervals:
    """The intersection of two unions (sorted, disjoint)."""
    out: Intervals = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if end > start:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def is_collective_kernel(event: dict[str, Any]) -> bool:
    args = event.get("args") or {}
    return "nccl" in str(event.get("name", "")).lower() or "Collective name" in args


def device_events(trace: dict[str, Any], device: int | None = None) -> list[dict[str, Any]]:
    """Kernels, copies and memsets (Kineto puts the device index in `pid`); `device`: only that
    device's."""
    return [
        e
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X"
        and e.get("cat") in DEVICE_CATEGORIES
        and (device is None or (e.get("args") or {}).get("device", e.get("pid")) == device)
    ]


def _span(e: dict[str, Any]) -> tuple[float, float]:
    start = float(e["ts"])
    return start, start + float(e.get("dur", 0.0))


def device_breakdown(trace: dict[str, Any], device: int | None = None) -> dict[str, Any] | None:
    """The median profiled step split as the module says, in seconds and as shares of the step;
    None when the trace has no device events (a CPU run) or no profiled step."""
    on_device = device_events(trace, device)
    events = trace.get("traceEvents", [])
    host = [e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"]
    steps = [e for e in host if str(e.get("name", "")).startswith("ProfilerStep#")]
    if not on_device or not steps:
        return None
    loop = {(e.get("pid"), e.get("tid")) for e in steps}  # the training loop's thread
    waits = [
        e for e in host if e.get("name") == "hpcml.data" and (e.get("pid"), e.get("tid")) in loop
    ]
    kernels = [e for e in on_device if e["cat"] == "kernel"]
    comm = union([_span(e) for e in kernels if is_collective_kernel(e)])
    compute = union([_span(e) for e in kernels if not is_collective_kernel(e)])
    busy = union([_span(e) for e in on_device])
    data = union([_span(e) for e in waits])
    per_step = [_split(_span(s), compute, comm, busy, data) for s in steps]
    out: dict[str, Any] = {"steps": len(per_step), "kernels": len(kernels)}
    for key in per_step[0]:
        out[key] = statistics.median(p[key] for p in per_step)
    for key in (*PARTS, "idle", "communication_in_flight"):
        out[f"{key}_share"] = out[f"{key}_s"] / out["step_s"] if out["step_s"] else 0.0
    return out


def _split(
    step: tuple[float, float], compute: Intervals, comm: Intervals, busy: Intervals, data: Intervals
) -> dict[str, float]:
    """One step's window split as the module says (seconds; the trace's times are in us)."""
    window = [step]
    c, m, b, d = (intersect(x, window) for x in (compute, comm, busy, data))
    # Differences of sums of the same edges: clamped at 0 against rounding's -1e-12.
    idle = max(0.0, length(window) - length(b))
    data_idle = max(0.0, length(d) - length(intersect(d, b)))
    parts = {
        "step_s": length(window),
        "compute_s": length(c),
        "communication_s": max(0.0, length(m) - length(intersect(m, c))),
        "memcpy_s": max(0.0, length(b) - length(union(c + m))),
        "data_s": data_idle,
        "host_overhead_s": max(0.0, idle - data_idle),
        "idle_s": idle,
        "communication_in_flight_s": length(m),
    }
    return {k: v / 1e6 for k, v in parts.items()}
