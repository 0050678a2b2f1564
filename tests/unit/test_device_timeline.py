"""The device-timeline breakdown (hpcml.observe.device_timeline) read from traces in the format
torch.profiler writes: a trace laid out as Kineto's ChromeTraceLogger prints it (output_json.cpp:
metadata events, device properties, runtime launches, flow events, relative `ts` with three
decimals, the device index as a kernel's `pid` and its stream as `tid`) with known times; and a
trace the real profiler wrote on this CPU machine, its host side untouched, with device events
added in that format (no GPU runs here; `tests/integration/test_fault_gpu.py` profiles a real
one under `make gpu`)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from hpcml.observe.device_timeline import device_breakdown

LOOP = '"pid": 4242, "tid": 4242'


def x(cat: str, name: str, where: str, ts: float, dur: float, args: str = "") -> str:
    """One complete event as ChromeTraceLogger::handleActivity prints it."""
    tail = f',\n    "args": {{\n      {args}\n    }}' if args else ""
    return (
        f'\n  {{\n    "ph": "X", "cat": "{cat}", "name": "{name}", {where},\n'
        f'    "ts": {ts:.3f}, "dur": {dur:.3f}{tail}\n  }},'
    )


def kernel(name: str, ts: float, dur: float, stream: int, corr: int, device: int = 0) -> str:
    args = (
        f'"External id": {corr + 100},"queued": 0, "device": {device}, "context": 1,'
        f' "stream": {stream}, "correlation": {corr}, "registers per thread": 32,'
        f' "shared memory": 0, "blocks per SM": 0.5, "warps per SM": 2.0,'
        f' "grid": [64, 1, 1], "block": [128, 1, 1], "est. achieved occupancy %": 6'
    )
    return x("kernel", name, f'"pid": {device}, "tid": {stream}', ts, dur, args)


def launch(ts: float, corr: int) -> str:
    """The runtime call that queued a device event, and its flow arrow (cat ac2g)."""
    args = f'"External id": {corr + 100}, "cbid": 211, "correlation": {corr}'
    return x("cuda_runtime", "cudaLaunchKernel", LOOP, ts, 4.0, args) + (
        f'\n  {{\n    "ph": "s", "id": {corr}, {LOOP}, "ts": {ts:.3f},\n'
        f'    "cat": "ac2g", "name": "ac2g"\n  }},'
    )


def kineto_trace() -> str:
    """Two profiled steps on device 0 (times in us; in brackets, each step's parts):

    step 3 [1000, 2000]: data wait on the loop 1000-1200; a batch copy 1150-1250; compute
      1300-1700 on stream 7 and 1400-1500 on stream 13 (counted once); NCCL 1650-1800 (50 under
      compute, 100 exposed); a kernel queued late runs 1950-2100, across into step 4.
      [compute 450, communication 100, memcpy 100, data 150 (1000-1150), host overhead 200]
    step 4 [2000, 4000]: data wait 2000-2800 with the device busy 2000-2150 (the late kernel,
      a memset); compute 2900-3500; a collective tagged by Kineto's `Collective name` 3400-3900.
      [compute 700, communication 400, memcpy 50, data 650, host overhead 200]
    Device 1's kernel and a data range on another thread must not count.
    """
    ev = [
        x("user_annotation", "ProfilerStep#3", LOOP, 1000, 1000, '"External id": 1'),
        x("user_annotation", "hpcml.data", LOOP, 1000, 200, '"External id": 2'),
        x("user_annotation", "hpcml.data", '"pid": 4242, "tid": 4250', 1000, 900),
        launch(1140, 1),
        x(
            "gpu_memcpy",
            "Memcpy HtoD (Pageable -> Device)",
            '"pid": 0, "tid": 7',
            1150,
            100,
            '"device": 0, "context": 1, "stream": 7, "correlation": 1, "bytes": 65536, '
            '"memory bandwidth (GB/s)": 0.65',
        ),
        launch(1290, 2),
        kernel("volta_sgemm_128x64_nn", 1300, 400, 7, 2),
        launch(1390, 3),
        kernel("void at::native::vectorized_elementwise_kernel<4>()", 1400, 100, 13, 3),
        launch(1590, 4),
        kernel("void at::native::reduce_kernel<512, 1>()", 1600, 100, 7, 4),
        launch(1640, 5),
        kernel(
            "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)",
            1650,
            150,
            20,
            5,
        ),
        launch(1900, 6),
        kernel("void at::native::elementwise_kernel<128, 2>()", 1950, 150, 7, 6),
        x("user_annotation", "ProfilerStep#4", LOOP, 2000, 2000, '"External id": 7'),
        x("user_annotation", "hpcml.data", LOOP, 2000, 800, '"External id": 8'),
        x(
            "gpu_memset",
            "Memset (Device)",
            '"pid": 0, "tid": 7',
            2100,
            50,
            '"device": 0, "context": 1, "stream": 7, "correlation": 7, "bytes": 512',
        ),
        kernel("sm90_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize128x128x32", 2900, 600, 7, 8),
        x(
            "kernel",
            "void c10d::symmetric_memory::one_shot_all_reduce_kernel()",
            '"pid": 0, "tid": 22',
            3400,
            500,
            '"device": 0, "stream": 22, "correlation": 9, "Collective name": "allreduce", '
            '"In msg nelems": 1024, "Out msg nelems": 1024, "Group size": 2, "dtype": "Float"',
        ),
        kernel("void at::native::vectorized_elementwise_kernel<4>()", 1000, 3000, 7, 10, device=1),
    ]
    meta = (
        '\n  {\n    "name": "process_name", "ph": "M", "ts": 900.000, "pid": 0, "tid": 0,\n'
        '    "args": {\n      "name": "python"\n    }\n  },'
        '\n  {\n    "name": "process_labels", "ph": "M", "ts": 900.000, "pid": 0, "tid": 0,\n'
        '    "args": {\n      "labels": "GPU 0"\n    }\n  },'
        '\n  {\n    "name": "thread_name", "ph": "M", "ts": 900.000, "pid": 0, "tid": 7,\n'
        '    "args": {\n      "name": "stream 7 "\n    }\n  },'
        '\n  {\n    "ph": "X", "cat": "Trace", "ts": 900.000, "dur": 3200.000,\n'
        '    "pid": "Spans", "tid": "PyTorch Profiler",\n    "name": "PyTorch Profiler (0)",\n'
        '    "args": {\n      "Op count": 0\n    }\n  },'
    )
    end = (
        '\n  {\n    "name": "Record Window End", "ph": "i", "s": "g",\n'
        '    "pid": "", "tid": "", "ts": 4100.000\n  }\n  ],'
        '\n  "distributedInfo": {"backend": "nccl", "rank": 0, "world_size": 2},'
        '\n  "traceName": "trace-rank-0.pt.trace.json"\n}'
    )
    props = (
        '{\n      "id": 0, "name": "NVIDIA H100 80GB HBM3", "totalGlobalMem": 85029158912,\n'
        '      "computeMajor": 9, "computeMinor": 0, "maxThreadsPerBlock": 1024,\n'
        '      "numSms": 132, "regsPerBlock": 65536, "warpSize": 32}'
    )
    head = (
        '\n  {\n    "schemaVersion": 1,\n    "deviceProperties": [\n      ' + props + "\n    ],"
        '\n  "displayTimeUnit": "ms",\n  "baseTimeNanoseconds": 1700000000000000000,'
        '\n  "traceEvents": ['
    )
    return head + meta + "".join(ev) + end


def test_device_timeline_of_a_kineto_trace() -> None:
    trace = json.loads(kineto_trace())  # the text parses as the JSON Kineto writes
    b = device_breakdown(trace, device=0)
    assert b is not None and b["steps"] == 2 and b["kernels"] == 7  # device 1's left out
    us = 1e-6
    # Medians of the two steps' parts (listed in kineto_trace's docstring).
    expected = {
        "step_s": 1500, "compute_s": 575, "communication_s": 250, "memcpy_s": 75,
        "data_s": 400, "host_overhead_s": 200, "idle_s": 600, "communication_in_flight_s": 325,
    }  # fmt: skip
    for key, value in expected.items():
        assert b[key] == pytest.approx(value * us), key
    assert b["compute_share"] == pytest.approx(575 / 1500)
    assert b["idle_share"] == pytest.approx(b["data_share"] + b["host_overhead_share"])
    # Here the medians' parts happen to add up to the median step, as each step's do.
    parts = ("compute", "communication", "memcpy", "data", "host_overhead")
    assert sum(b[f"{p}_share"] for p in parts) == pytest.approx(1.0)


def test_host_ranges_of_a_real_profiler_trace_with_device_events(tmp_path: Path) -> None:
    """torch.profiler's own trace of three steps (a data wait, then work) on this machine: no
    device events, no device breakdown; with a kernel added from the end of each real data wait
    to the end of its real step, the parts are those the real ranges give."""
    path = tmp_path / "trace-rank-0.pt.trace.json"
    with profile(
        activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=3, repeat=1)
    ) as prof:
        for _ in range(4):
            with record_function("hpcml.data"):
                time.sleep(0.002)
            with record_function("hpcml.forward"):
                torch.ones(64, 64) @ torch.ones(64, 64)
            prof.step()
    prof.export_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    assert device_breakdown(trace) is None  # a CPU run: no device part
    steps = [e for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")]
    waits = [e for e in trace["traceEvents"] if e.get("name") == "hpcml.data"]
    assert len(steps) == 3 and len(waits) == 3
    parts = {"compute_s": [], "data_s": [], "host_overhead_s": []}
    by_time = sorted(steps, key=lambda e: e["ts"]), sorted(waits, key=lambda e: e["ts"])
    for i, (s, w) in enumerate(zip(*by_time, strict=True)):
        end, wait_end = s["ts"] + s["dur"], w["ts"] + w["dur"]
        trace["traceEvents"].append(json.loads(kernel("k", wait_end, end - wait_end, 7, i)[3:-1]))
        parts["compute_s"].append(end - wait_end)
        parts["data_s"].append(w["dur"])
        parts["host_overhead_s"].append(w["ts"] - s["ts"])  # before the wait: nothing queued
    b = device_breakdown(trace, device=0)
    assert b is not None and b["steps"] == 3
    assert b["step_s"] == pytest.approx(sorted(e["dur"] for e in steps)[1] * 1e-6)
    for key, values in parts.items():
        # ts and dur carry three decimals of a us: 1 ns of rounding per edge.
        assert b[key] == pytest.approx(sorted(values)[1] * 1e-6, abs=1e-8), key
    assert b["communication_s"] == 0 and b["memcpy_s"] == 0
