"""The hardware catalog: accelerators, links and node shapes, read from YAML shipped with hpcml.

Users add or replace entries with their own YAML of the same layout (`--catalog FILE` or the
HPCML_CATALOG environment variable). `peak_flops_per_s` is what the training engine calls to
turn its measured FLOP rate into MFU.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from hpcml.plan.common import PlanError, normalize_precision

CATALOG_ENV = "HPCML_CATALOG"


@dataclass(frozen=True)
class Price:
    provider: str
    kind: str
    """on-demand, spot or reserved."""
    usd_per_gpu_hour: float
    as_of: str
    source: str = ""


@dataclass(frozen=True)
class Accelerator:
    key: str
    display: str
    vendor: str
    memory_bytes: int | None
    """None for host memory (CPU), which the planner does not check."""
    memory_bandwidth_bytes_per_s: float
    peak_flops: Mapping[str, float]
    tdp_watts: float
    default_node: str
    default_efficiency: float
    match: tuple[str, ...] = ()
    prices: tuple[Price, ...] = ()
    purchase_usd_per_gpu: float | None = None
    purchase_as_of: str = ""
    source: str = ""
    cores: int | None = None
    """CPU entries: the cores the peak figures are for. A CPU "device" is one process, which
    computes with the threads it is given: see `per_threads`."""

    def per_threads(self, threads: int) -> Accelerator:
        """A CPU process computing with `threads` threads: the peak scaled to that share of the
        entry's cores. hpcml gives each of N ranks on one host cores // N threads, so one
        rank of two on a 2-core machine has half the single process's peak."""
        if not self.cores or threads < 1:
            return self
        share = threads / self.cores
        return replace(self, peak_flops={k: v * share for k, v in self.peak_flops.items()})

    def peak(self, precision: str) -> float:
        """Dense peak FLOP/s at `precision`; tf32 falls back to fp32 where there is none (CPU)."""
        p = normalize_precision(precision)
        if p in self.peak_flops:
            return float(self.peak_flops[p])
        if p == "tf32" and "fp32" in self.peak_flops:
            return float(self.peak_flops["fp32"])
        raise PlanError(
            f"accelerator '{self.key}' has no peak FLOP/s for precision {p} in the catalog; "
            f"it lists {', '.join(self.peak_flops)}."
        )

    def price(self, provider: str | None = None, kind: str = "on-demand") -> Price | None:
        """The offer of `provider`, or the cheapest listed offer of that kind."""
        offers = [
            o
            for o in self.prices
            if o.kind == kind and (provider is None or o.provider == provider)
        ]
        return min(offers, key=lambda o: o.usd_per_gpu_hour) if offers else None


@dataclass(frozen=True)
class Link:
    key: str
    kind: str
    bandwidth_bytes_per_s: float
    """Per direction, per endpoint."""
    latency_s: float
    efficiency: float = 1.0
    """Share of the nominal bandwidth that nccl-tests' bus bandwidth reaches."""
    source: str = ""

    @property
    def effective_bandwidth(self) -> float:
        return self.bandwidth_bytes_per_s * self.efficiency


@dataclass(frozen=True)
class NodeShape:
    key: str
    accelerator: str
    devices_per_node: int
    intra_link: str
    inter_link: str
    nics_per_node: int
    host_watts: float = 0.0
    """Power of everything in the node but the accelerators (CPUs, NICs, fans)."""
    source: str = ""


@dataclass(frozen=True)
class Catalog:
    accelerators: Mapping[str, Accelerator]
    links: Mapping[str, Link]
    nodes: Mapping[str, NodeShape]
    sources: tuple[str, ...] = field(default=())

    def accelerator(self, name: str) -> Accelerator:
        acc = self.accelerators.get(name.lower()) or match_accelerator(self, name)
        if acc is None:
            raise PlanError(
                f"accelerator '{name}' is not in the hardware catalog; known ones are "
                f"{', '.join(sorted(self.accelerators))} (add yours to a YAML passed with --catalog)."
            )
        return acc

    def link(self, name: str) -> Link:
        link = self.links.get(name.lower())
        if link is None:
            raise PlanError(
                f"link '{name}' is not in the hardware catalog; known links are "
                f"{', '.join(sorted(self.links))} (add yours to a YAML passed with --catalog)."
            )
        return link

    def node(self, name: str) -> NodeShape:
        node = self.nodes.get(name.lower())
        if node is None:
            raise PlanError(
                f"node shape '{name}' is not in the hardware catalog; known shapes are "
                f"{', '.join(sorted(self.nodes))} (add yours to a YAML passed with --catalog)."
            )
        return node


@dataclass(frozen=True)
class Cluster:
    """What a plan runs on: `devices` accelerators, `devices_per_node` to a node."""

    accelerator: Accelerator
    devices: int
    devices_per_node: int
    intra: Link
    inter: Link
    nics_per_node: int
    host_watts_per_node: float = 0.0
    node_key: str = ""

    @property
    def nodes(self) -> int:
        return -(-self.devices // self.devices_per_node)

    @property
    def inter_bandwidth_per_device(self) -> float:
        """A device's share of its node's network bandwidth (effective, per direction)."""
        return self.nics_per_node * self.inter.effective_bandwidth / self.devices_per_node

    def describe(self) -> str:
        return (
            f"{self.devices} x {self.accelerator.key} ({self.devices_per_node} per node, "
            f"{self.intra.key} inside, {self.nics_per_node} x {self.inter.key} between nodes)"
        )


# --- loading ---------------------------------------------------------------------------------


def _read_yaml(text: str, origin: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError:
        raise PlanError(f"hardware catalog {origin} is not valid YAML; fix its syntax.") from None
    if not isinstance(data, dict):
        raise PlanError(
            f"hardware catalog {origin} must be a mapping with accelerators, links and nodes."
        )
    unknown = set(data) - {"accelerators", "links", "nodes"}
    if unknown:
        raise PlanError(
            f"hardware catalog {origin} has unknown top-level keys {sorted(unknown)}; "
            "allowed are accelerators, links, nodes."
        )
    return data


def _build_accelerator(key: str, d: Mapping[str, Any], origin: str) -> Accelerator:
    try:
        prices = tuple(
            Price(
                provider=str(p["provider"]),
                kind=str(p.get("kind", "on-demand")),
                usd_per_gpu_hour=float(p["usd_per_gpu_hour"]),
                as_of=str(p.get("as_of", "")),
                source=str(p.get("source", "")),
            )
            for p in d.get("prices") or []
        )
        peak = {normalize_precision(k): float(v) for k, v in dict(d["peak_flops"]).items()}
        mem = d.get("memory_bytes")
        purchase = d.get("purchase_usd_per_gpu")
        return Accelerator(
            key=key,
            display=str(d.get("display", key)),
            vendor=str(d.get("vendor", "")),
            memory_bytes=int(float(mem)) if mem is not None else None,
            memory_bandwidth_bytes_per_s=float(d["memory_bandwidth_bytes_per_s"]),
            peak_flops=peak,
            tdp_watts=float(d.get("tdp_watts", 0.0)),
            default_node=str(d.get("default_node", "")),
            default_efficiency=float(d.get("default_efficiency", 0.4)),
            match=tuple(str(m) for m in d.get("match") or ()),
            prices=prices,
            purchase_usd_per_gpu=float(purchase) if purchase is not None else None,
            purchase_as_of=str(d.get("purchase_as_of", "")),
            source=str(d.get("source", "")),
            cores=int(d["cores"]) if d.get("cores") is not None else None,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise PlanError(
            f"accelerator '{key}' in {origin} is incomplete or malformed ({exc}); it needs "
            "peak_flops, memory_bandwidth_bytes_per_s and numeric values."
        ) from None


def _build_link(key: str, d: Mapping[str, Any], origin: str) -> Link:
    try:
        return Link(
            key=key,
            kind=str(d.get("kind", "")),
            bandwidth_bytes_per_s=float(d["bandwidth_bytes_per_s"]),
            latency_s=float(d["latency_s"]),
            efficiency=float(d.get("efficiency", 1.0)),
            source=str(d.get("source", "")),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise PlanError(
            f"link '{key}' in {origin} is incomplete or malformed ({exc}); it needs "
            "bandwidth_bytes_per_s and latency_s."
        ) from None


def _build_node(key: str, d: Mapping[str, Any], origin: str) -> NodeShape:
    try:
        return NodeShape(
            key=key,
            accelerator=str(d["accelerator"]),
            devices_per_node=int(d["devices_per_node"]),
            intra_link=str(d["intra_link"]),
            inter_link=str(d["inter_link"]),
            nics_per_node=int(d.get("nics_per_node", 1)),
            host_watts=float(d.get("host_watts", 0.0)),
            source=str(d.get("source", "")),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise PlanError(
            f"node shape '{key}' in {origin} is incomplete or malformed ({exc}); it needs "
            "accelerator, devices_per_node, intra_link and inter_link."
        ) from None


def _merge_fields(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """`over` on top of `base`, field by field (nested mappings such as peak_flops too), so a
    later catalog can change one number of an entry without restating the rest."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _merge_fields(out[k], v)
        else:
            out[k] = v
    return out


def _merge(
    layers: Iterable[tuple[str, str]],
) -> Catalog:
    raw: dict[str, dict[str, tuple[dict[str, Any], str]]] = {
        "accelerators": {},
        "links": {},
        "nodes": {},
    }
    origins: list[str] = []
    for text, origin in layers:
        data = _read_yaml(text, origin)
        origins.append(origin)
        for section, table in raw.items():
            entries = data.get(section) or {}
            if not isinstance(entries, Mapping):
                raise PlanError(f"'{section}' in hardware catalog {origin} must be a mapping.")
            for k, v in entries.items():
                if not isinstance(v, Mapping):
                    raise PlanError(
                        f"{section[:-1]} '{k}' in {origin} must be a mapping of fields."
                    )
                key = str(k).lower()
                before = table.get(key, ({}, origin))[0]
                table[key] = (_merge_fields(before, v), origin)
    accs = {k: _build_accelerator(k, v, o) for k, (v, o) in raw["accelerators"].items()}
    links = {k: _build_link(k, v, o) for k, (v, o) in raw["links"].items()}
    nodes = {k: _build_node(k, v, o) for k, (v, o) in raw["nodes"].items()}
    for node in nodes.values():
        for ref, table2 in (
            (node.accelerator, accs),
            (node.intra_link, links),
            (node.inter_link, links),
        ):
            if ref.lower() not in table2:
                raise PlanError(
                    f"node shape '{node.key}' names '{ref}', which is not in the catalog; "
                    "define it or fix the name."
                )
    return Catalog(accelerators=accs, links=links, nodes=nodes, sources=tuple(origins))


def _shipped_text() -> str:
    return (resources.files("hpcml.plan") / "catalog" / "hardware.yaml").read_text()


@lru_cache(maxsize=8)
def _load_cached(extra: tuple[str, ...]) -> Catalog:
    layers = [(_shipped_text(), "the shipped catalog")]
    for path in extra:
        p = Path(path).expanduser()
        if not p.is_file():
            raise PlanError(f"hardware catalog {p} does not exist; pass the path of a YAML file.")
        layers.append((p.read_text(), str(p)))
    return _merge(layers)


def load_catalog(extra_paths: Iterable[str | Path] = ()) -> Catalog:
    """The shipped catalog, then files in HPCML_CATALOG, then `extra_paths`; later entries win."""
    env = [p for p in os.environ.get(CATALOG_ENV, "").split(os.pathsep) if p.strip()]
    return _load_cached(tuple(env) + tuple(str(p) for p in extra_paths))


# --- matching device names -------------------------------------------------------------------


def match_accelerator(catalog: Catalog, device_name: str) -> Accelerator | None:
    """The catalog entry for a torch device name ("NVIDIA H100 80GB HBM3", "cpu"), or None.

    Each entry lists regular expressions; the longest pattern that matches wins, so
    "NVIDIA H100 PCIe" picks h100-pcie over a generic h100 pattern.
    """
    name = device_name.strip().lower()
    if name in catalog.accelerators:
        return catalog.accelerators[name]
    best: tuple[int, Accelerator] | None = None
    for acc in catalog.accelerators.values():
        for pattern in acc.match:
            if re.search(pattern, name) and (best is None or len(pattern) > best[0]):
                best = (len(pattern), acc)
    return best[1] if best else None


def peak_flops_per_s(device_name: str, precision: str) -> float | None:
    """Dense peak FLOP/s of a device named as torch names it, at a training precision.

    None when the device is not in the catalog or lists no figure for that precision, so
    callers report MFU as unknown rather than guess.
    """
    acc = match_accelerator(load_catalog(), device_name)
    if acc is None:
        return None
    try:
        return acc.peak(precision)
    except PlanError:
        return None


def resolve_cluster(
    catalog: Catalog,
    devices: int,
    accelerator: str | None = None,
    node: str | None = None,
    devices_per_node: int | None = None,
    intra: str | None = None,
    inter: str | None = None,
    nics_per_node: int | None = None,
) -> Cluster:
    """A cluster from a node shape and/or an accelerator, with explicit overrides."""
    if devices < 1:
        raise PlanError(f"--devices is {devices}; it must be at least 1.")
    if node is None:
        acc = catalog.accelerator(accelerator or "h100-sxm")
        node = acc.default_node or None
    shape = catalog.node(node) if node else None
    acc = (
        catalog.accelerator(accelerator)
        if accelerator
        else catalog.accelerator(shape.accelerator if shape else "h100-sxm")
    )
    per_node = devices_per_node or (shape.devices_per_node if shape else 8)
    if per_node < 1:
        raise PlanError(f"--gpus-per-node is {per_node}; it must be at least 1.")
    return Cluster(
        accelerator=acc,
        devices=devices,
        devices_per_node=per_node,
        intra=catalog.link(intra or (shape.intra_link if shape else "nvlink4")),
        inter=catalog.link(inter or (shape.inter_link if shape else "ib-ndr")),
        nics_per_node=nics_per_node or (shape.nics_per_node if shape else per_node),
        host_watts_per_node=shape.host_watts if shape else 0.0,
        node_key=shape.key if shape else "",
    )
