"""Collective communication times on a two-level topology, and the per-step communication of
data, tensor and pipeline parallelism.

Latency-bandwidth (alpha-beta) model: time = steps x alpha + bytes on the busiest link / B
(Hockney 1994; ring and tree costs as in Thakur, Rabenseifner & Gropp 2005, "Optimization of
Collective Communication Operations in MPICH"). Algorithm and bus bandwidth are reported as
nccl-tests defines them (NVIDIA/nccl-tests, doc/PERFORMANCE.md).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from hpcml.plan.common import PlanError
from hpcml.plan.hardware import Cluster
from hpcml.plan.memory import Layout, Training, params_per_device
from hpcml.plan.shapes import ModelShape

DDP_BUCKET_BYTES = 25 * 2**20  # torch DDP's default bucket_cap_mb (hpcml passes 25 explicitly)

OPS = ("allreduce", "allgather", "reducescatter", "broadcast", "reduce", "alltoall", "sendrecv")
ALGORITHMS = ("auto", "ring", "tree")


def bus_bandwidth_factor(op: str, n: int) -> float:
    """busbw = algbw x factor (nccl-tests doc/PERFORMANCE.md, "Summary").

    AllReduce 2(n-1)/n; ReduceScatter, AllGather and AlltoAll (n-1)/n; Broadcast, Reduce and
    point-to-point 1.
    """
    if op not in OPS:
        raise PlanError(f"collective '{op}' is not known; use one of {', '.join(OPS)}.")
    if n < 1:
        raise PlanError(f"a collective needs at least one rank, not {n}.")
    if op == "allreduce":
        return 2.0 * (n - 1) / n
    if op in ("allgather", "reducescatter", "alltoall"):
        return (n - 1) / n
    return 1.0


@dataclass(frozen=True)
class Group:
    """Where a communicator's ranks sit: n ranks, at most `per_node` of them on one node."""

    n: int
    per_node: int

    @property
    def nodes(self) -> int:
        return -(-self.n // self.per_node)


@dataclass(frozen=True)
class CollectiveTime:
    op: str
    algorithm: str
    size_bytes: float
    """nccl-tests' S: the whole buffer (for allgather/reducescatter: count per rank x n)."""
    ranks: int
    time_s: float
    algbw_bytes_per_s: float
    busbw_bytes_per_s: float
    link_bandwidth_bytes_per_s: float
    latency_s: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _link_params(cluster: Cluster, group: Group) -> tuple[float, float]:
    """(bandwidth per rank, latency per step) of the slowest hop of a ring over `group`.

    Inside a node every rank has its full intra-node bandwidth. Across nodes NCCL runs one
    ring per channel, each leaving the node through a different NIC, so a group with k ranks
    per node can push k x (a device's share of the node's NICs), capped by the intra-node
    bandwidth (NCCL's multi-ring design; nccl-tests reach about the NICs' line rate).
    """
    intra = cluster.intra.effective_bandwidth
    if group.nodes <= 1:
        return intra, cluster.intra.latency_s
    across = min(group.per_node, cluster.devices_per_node) * cluster.inter_bandwidth_per_device
    return min(intra, across), max(cluster.inter.latency_s, cluster.intra.latency_s)


def collective_time(
    op: str,
    size_bytes: float,
    cluster: Cluster,
    group: Group | None = None,
    algorithm: str = "auto",
) -> CollectiveTime:
    """Time of one collective of `size_bytes` (nccl-tests' S) over `group` on `cluster`."""
    if algorithm not in ALGORITHMS:
        raise PlanError(f"algorithm '{algorithm}' is not known; use {', '.join(ALGORITHMS)}.")
    if size_bytes < 0:
        raise PlanError(f"message size {size_bytes} is negative; give a size in bytes.")
    group = group or Group(cluster.devices, min(cluster.devices, cluster.devices_per_node))
    n = group.n
    factor = bus_bandwidth_factor(op, n)
    bw, alpha = _link_params(cluster, group)
    if n == 1:
        return CollectiveTime(op, "none", size_bytes, 1, 0.0, math.inf, math.inf, bw, 0.0)

    def ring() -> tuple[float, float]:
        if op == "allreduce":
            # Reduce-scatter then all-gather: 2(n-1) steps, each moving S/n (Patarasuk & Yuan
            # 2009, "Bandwidth optimal all-reduce algorithms for clusters of workstations").
            return 2 * (n - 1) * alpha + factor * size_bytes / bw, 2 * (n - 1) * alpha
        if op in ("allgather", "reducescatter"):
            return (n - 1) * alpha + factor * size_bytes / bw, (n - 1) * alpha
        if op in ("broadcast", "reduce"):
            # Pipelined ring: the root's link carries S once; the pipeline fills in n-1 steps.
            return (n - 1) * alpha + size_bytes / bw, (n - 1) * alpha
        if op == "alltoall":
            # Pairwise exchange: (n-1)/n of S leaves each rank; the part for other nodes
            # goes through this rank's share of the NICs.
            off_node = (n - min(group.per_node, n)) / n
            on_node = (min(group.per_node, n) - 1) / n
            t_intra = on_node * size_bytes / cluster.intra.effective_bandwidth
            t_inter = (
                off_node * size_bytes / cluster.inter_bandwidth_per_device if off_node else 0.0
            )
            return (n - 1) * alpha + max(t_intra, t_inter), (n - 1) * alpha
        # sendrecv: one hop.
        p2p_bw = (
            cluster.intra.effective_bandwidth
            if group.nodes <= 1
            else min(cluster.intra.effective_bandwidth, cluster.inter_bandwidth_per_device)
        )
        return alpha + size_bytes / p2p_bw, alpha

    def tree() -> tuple[float, float]:
        # NCCL's tree: a chain inside each node and a double binary tree across nodes
        # (Sanders, Speck & Traeff 2009, "Two-tree algorithms for full bandwidth broadcast,
        # reduction and scan"); reduce up then broadcast down, each tree carrying half of S.
        depth = (min(group.per_node, n) - 1) * cluster.intra.latency_s
        if group.nodes > 1:
            depth += math.ceil(math.log2(group.nodes)) * cluster.inter.latency_s
        if op == "allreduce":
            return 2 * depth + 2 * size_bytes / bw, 2 * depth
        if op in ("broadcast", "reduce"):
            return depth + size_bytes / bw, depth
        raise PlanError(
            f"the tree algorithm implements allreduce, broadcast and reduce, not {op}; "
            "use --algorithm ring."
        )

    if op in ("alltoall", "sendrecv"):
        chosen, (t, lat) = ("pairwise" if op == "alltoall" else "p2p"), ring()
    elif algorithm == "ring" or op not in ("allreduce", "broadcast", "reduce"):
        chosen, (t, lat) = "ring", ring()
    elif algorithm == "tree":
        chosen, (t, lat) = "tree", tree()
    else:
        # Like NCCL's tuner: take whichever is predicted faster for this size.
        r, tr = ring(), tree()
        chosen, (t, lat) = ("ring", r) if r[0] <= tr[0] else ("tree", tr)
    algbw = size_bytes / t if t > 0 else math.inf
    return CollectiveTime(op, chosen, size_bytes, n, t, algbw, algbw * factor, bw, lat)


# --- per-step communication of parallel layouts ----------------------------------------------


@dataclass(frozen=True)
class CommItem:
    name: str
    op: str
    size_bytes: float
    calls_per_step: float
    group: Group
    time_per_call_s: float
    overlap: str
    """What it can hide behind: "backward" (DP gradients), "compute" (ZeRO-3 prefetch) or
    "none" (on the critical path: TP, PP, ZeRO parameter all-gather after the step)."""

    @property
    def time_s(self) -> float:
        return self.time_per_call_s * self.calls_per_step

    @property
    def volume_bytes(self) -> float:
        """Bytes each rank sends per step (bus bytes: S x busbw factor)."""
        return self.size_bytes * bus_bandwidth_factor(self.op, self.group.n) * self.calls_per_step

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "op": self.op,
            "size_bytes": self.size_bytes,
            "calls_per_step": self.calls_per_step,
            "ranks": self.group.n,
            "ranks_per_node": min(self.group.per_node, self.group.n),
            "time_per_call_s": self.time_per_call_s,
            "time_s": self.time_s,
            "volume_bytes": self.volume_bytes,
            "overlap": self.overlap,
        }


def groups(cluster: Cluster, layout: Layout) -> tuple[Group, Group, Group]:
    """(tp, dp, pp) groups with ranks ordered tensor-innermost, then data, then pipeline
    (Megatron-LM's default order; Narayanan et al. 2021, Sec. 3.3: keep TP inside a node)."""
    g = cluster.devices_per_node
    dp = layout.dp(cluster.devices)
    tp_group = Group(layout.tp, min(layout.tp, g))
    dp_per_node = max(1, min(dp, g // layout.tp)) if layout.tp <= g else 1
    dp_group = Group(dp, dp_per_node)
    stride = layout.tp * dp
    pp_per_node = max(1, min(layout.pp, g // stride)) if stride <= g else 1
    pp_group = Group(layout.pp, pp_per_node)
    return tp_group, dp_group, pp_group


def step_communication(
    model: ModelShape, layout: Layout, training: Training, cluster: Cluster
) -> list[CommItem]:
    """The collectives one optimizer step issues on the busiest device.

    Volumes follow the ZeRO paper, Sec. 7: DDP all-reduces gradients (2 Psi); ZeRO-1/2
    reduce-scatter gradients and all-gather parameters (2 Psi); ZeRO-3 also gathers again in
    backward (3 Psi). Calls are counted as the implementations hpcml runs issue them (checked
    against the torch profiler by tests/integration/test_planned_collectives.py): DDP one
    all-reduce per 25 MiB bucket (no buffer broadcast in a step); torch's
    ZeroRedundancyOptimizer (hpcml's zero1, `zero1_whole_tensors`) DDP's all-reduce plus one
    parameter broadcast per rank; FSDP2 (zero2, zero3) one all-gather per unit and micro-batch
    in forward, zero3 again for all but the last unit in backward, and one reduce-scatter per
    unit and step. TP: two all-reduces in forward and two in backward per block (Shoeybi et al.
    2019, Sec. 3), each replaced by an all-gather + reduce-scatter pair under SP (Korthikanti et
    al. 2022, Sec. 4.2.2); full recomputation repeats the forward pair. PP: one activation
    send forward and one gradient send backward per micro-batch and stage boundary.
    """
    dp = layout.validate(model, cluster.devices)
    tp_g, dp_g, pp_g = groups(cluster, layout)
    m = layout.grad_accum
    items: list[CommItem] = []

    def add(name: str, op: str, size: float, calls: float, group: Group, overlap: str) -> None:
        if group.n > 1 and size > 0 and calls > 0:
            t = collective_time(op, size, cluster, group).time_s
            items.append(CommItem(name, op, size, calls, group, t, overlap))

    n_params = params_per_device(model, layout)
    grad_size = n_params * training.grad_bytes
    param_size = n_params * training.param_bytes
    # gloo (CPU processes) has no reduce-scatter of its own: it all-reduces the whole buffer
    # and keeps a shard, so a gradient reduce-scatter costs an all-reduce there.
    reduce_op = "allreduce" if cluster.accelerator.cores is not None else "reducescatter"
    if layout.zero == 0 or (layout.zero == 1 and layout.zero1_whole_tensors):
        # DDP: one all-reduce per gradient bucket (bucket_cap_mb). hpcml's DDP does not
        # broadcast its buffers (BatchNorm statistics) before every forward
        # (`broadcast_buffers=False`): rank 0's are sent before each evaluation and checkpoint,
        # not in a training step.
        buckets = max(1, math.ceil(grad_size / DDP_BUCKET_BYTES))
        add("DP gradient all-reduce", "allreduce", grad_size / buckets, buckets, dp_g, "backward")
        if layout.zero == 1:
            # torch's ZeroRedundancyOptimizer (hpcml's zero1) sits on DDP: each rank steps the
            # tensors it owns, then broadcasts them as one bucket (`parameters_as_bucket_view`).
            add("ZeRO-1 parameter broadcast", "broadcast", param_size / dp, dp, dp_g, "none")
    elif layout.zero == 1:
        add("ZeRO gradient reduce-scatter", reduce_op, grad_size, 1, dp_g, "backward")
        add("ZeRO parameter all-gather", "allgather", param_size, 1, dp_g, "none")
    else:
        # FSDP2 (hpcml's zero2 and zero3, torchtitan's): one all-gather and one reduce-scatter
        # per unit (wrapped block), so a deep model pays the collectives' latency per unit.
        # zero3 gathers every unit in forward and all but the last again in backward (the
        # last is kept for the backward that starts with it); zero2 keeps what forward
        # gathered. Gradients are reduced once per step (no sync on earlier micro-batches),
        # or once per micro-batch with accum_reduce "micro_batch".
        u = model.gather_units
        gathers = u if layout.zero == 2 else 2 * u - 1
        add("FSDP parameter all-gather", "allgather", param_size / u, m * gathers, dp_g, "compute")
        rs_calls = u * (m if layout.accum_reduce == "micro_batch" else 1)
        add("FSDP gradient reduce-scatter", reduce_op, grad_size / u, rs_calls, dp_g, "compute")

    if model.is_transformer:
        layers = math.ceil(model.layers / layout.pp)
        act = float(model.seq) * layout.micro_batch * model.hidden * training.activation_bytes
        per_mb = 4 + (2 if layout.recompute == "full" else 0)
        if layout.tp > 1:
            if layout.sp:
                add("TP+SP all-gather", "allgather", act, m * layers * per_mb, tp_g, "none")
                add("TP+SP reduce-scatter", "reducescatter", act, m * layers * per_mb, tp_g, "none")
            else:
                add("TP all-reduce", "allreduce", act, m * layers * per_mb, tp_g, "none")
        if layout.pp > 1:
            # Megatron's scatter-gather optimisation sends 1/t of the activation per TP rank
            # (Narayanan et al. 2021, Sec. 4.1).
            v = layout.virtual_stages if layout.schedule == "interleaved" else 1
            add("PP activation send/recv", "sendrecv", act / layout.tp, 2 * m * v, pp_g, "none")
    del dp
    return items
