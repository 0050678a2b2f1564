"""Shared pieces of the planner: its user error, unit constants, precision names and a safe
lookup into nested run records."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hpcml.errors import HpcmlError

GB = 1e9
GiB = 2**30
HOUR_S = 3600.0
DAY_S = 86400.0

# Bytes per element of each training precision.
DTYPE_BYTES: dict[str, int] = {
    "fp64": 8,
    "fp32": 4,
    "tf32": 4,  # tf32 is an fp32 storage format computed on tensor cores
    "bf16": 2,
    "fp16": 2,
    "fp8": 1,
    "int8": 1,
    "fp4": 1,
}

_PRECISION_ALIASES = {
    "float32": "fp32",
    "float": "fp32",
    "32": "fp32",
    "float64": "fp64",
    "double": "fp64",
    "bfloat16": "bf16",
    "bf16-mixed": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "16": "fp16",
    "16-mixed": "fp16",
    "float8": "fp8",
    "fp8-e4m3": "fp8",
}


class PlanError(HpcmlError):
    """A planning request that cannot be answered: bad layout, unknown hardware, no fit."""


def normalize_precision(precision: str) -> str:
    p = precision.strip().lower()
    p = _PRECISION_ALIASES.get(p, p)
    if p not in DTYPE_BYTES:
        raise PlanError(
            f"precision '{precision}' is not known; use one of {', '.join(DTYPE_BYTES)}."
        )
    return p


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def human_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    if s >= DAY_S:
        return f"{s / DAY_S:.1f} d"
    if s >= HOUR_S:
        return f"{s / HOUR_S:.1f} h"
    if s >= 60:
        return f"{s / 60:.1f} min"
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def get_path(d: Mapping[str, Any], *path: str, default: Any = None) -> Any:
    """`d[path[0]][path[1]]...`, or `default` where a key is missing or a level is not a
    mapping (summary.json and config.yaml blocks that older runs lack)."""
    cur: Any = d
    for p in path:
        if not isinstance(cur, Mapping) or p not in cur:
            return default
        cur = cur[p]
    return cur
