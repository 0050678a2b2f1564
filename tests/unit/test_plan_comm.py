"""Collective and per-step communication model: nccl-tests' bus bandwidth, ZeRO volumes."""

from __future__ import annotations

import pytest

from hpcml.plan.comm import Group, bus_bandwidth_factor, collective_time, step_communication
from hpcml.plan.common import PlanError
from hpcml.plan.hardware import load_catalog, resolve_cluster
from hpcml.plan.memory import Layout, Training
from hpcml.plan.shapes import ModelShape, model_shape

CAT = load_catalog()


def test_nccl_tests_bus_bandwidth_factors() -> None:
    # NVIDIA/nccl-tests doc/PERFORMANCE.md, "Summary".
    n = 8
    assert bus_bandwidth_factor("allreduce", n) == 2 * 7 / 8
    for op in ("reducescatter", "allgather", "alltoall"):
        assert bus_bandwidth_factor(op, n) == 7 / 8
    for op in ("broadcast", "reduce", "sendrecv"):
        assert bus_bandwidth_factor(op, n) == 1
    with pytest.raises(PlanError, match="not known"):
        bus_bandwidth_factor("gather", n)


@pytest.mark.parametrize("op", ["allreduce", "allgather", "reducescatter", "broadcast"])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_bus_bandwidth_is_rank_independent_for_large_messages(op: str, n: int) -> None:
    # The point of busbw: at large sizes it approaches the link bandwidth whatever n is.
    cluster = resolve_cluster(CAT, n, accelerator="h100-sxm")
    t = collective_time(op, 8e9, cluster, algorithm="ring")
    assert t.busbw_bytes_per_s == pytest.approx(cluster.intra.effective_bandwidth, rel=0.01)
    assert t.algbw_bytes_per_s == pytest.approx(t.size_bytes / t.time_s)


def test_small_messages_are_latency_bound_and_tree_wins_at_scale() -> None:
    cluster = resolve_cluster(CAT, 256, node="hgx-h100")
    ring = collective_time("allreduce", 8, cluster, algorithm="ring")
    tree = collective_time("allreduce", 8, cluster, algorithm="tree")
    assert tree.time_s < ring.time_s / 10  # log2 vs linear latency
    assert collective_time("allreduce", 8, cluster).algorithm == "tree"
    two_nodes = resolve_cluster(CAT, 16, node="hgx-h100")
    big_ring = collective_time("allreduce", 16e9, two_nodes, algorithm="ring")
    big_tree = collective_time("allreduce", 16e9, two_nodes, algorithm="tree")
    assert big_ring.time_s < big_tree.time_s  # ring moves 2(n-1)/n S, the tree 2 S


def test_crossing_nodes_is_slower_and_uses_the_nics() -> None:
    one = resolve_cluster(CAT, 8, node="hgx-h100")
    two = resolve_cluster(CAT, 16, node="hgx-h100")
    a = collective_time("allreduce", 4e9, one, algorithm="ring")
    b = collective_time("allreduce", 4e9, two, algorithm="ring")
    assert b.busbw_bytes_per_s < a.busbw_bytes_per_s
    # 8 x NDR 400 Gb/s per node: busbw tops out near the node's NIC line rate.
    nic = 8 * CAT.link("ib-ndr").effective_bandwidth
    assert b.link_bandwidth_bytes_per_s == pytest.approx(min(nic, one.intra.effective_bandwidth))
    # One rank per node: only that device's share of the NICs.
    sparse = collective_time("allreduce", 4e9, two, Group(2, 1), algorithm="ring")
    assert sparse.link_bandwidth_bytes_per_s == pytest.approx(nic / 8)


def test_zero_paper_communication_volumes() -> None:
    # ZeRO paper Sec. 7: DDP and ZeRO-1/2 move 2 Psi per rank, ZeRO-3 moves 3 Psi; FSDP2 keeps
    # the last of its u units gathered from forward into backward, so (3 - 1/u) Psi.
    psi = 1_000_000_000
    u = 64
    m = ModelShape("psi", psi, units=u)
    cluster = resolve_cluster(CAT, 64, node="hgx-h100")
    tr = Training("bf16")

    def volume(zero: int) -> float:
        return sum(c.volume_bytes for c in step_communication(m, Layout(zero=zero), tr, cluster))

    n = 64
    assert volume(0) == pytest.approx(2 * (n - 1) / n * 2 * psi)
    assert volume(1) == pytest.approx(volume(0))
    assert volume(2) == pytest.approx(volume(0))
    assert volume(3) / volume(0) == pytest.approx((3 - 1 / u) / 2)


def test_tensor_and_pipeline_parallel_communication() -> None:
    m = model_shape("gpt-1.3b")
    cluster = resolve_cluster(CAT, 16, node="hgx-h100")
    tr = Training("bf16")
    items = step_communication(m, Layout(tp=8, grad_accum=4), tr, cluster)
    tp = [c for c in items if c.name.startswith("TP")]
    # Four all-reduces of s*b*h per block per micro-batch (Shoeybi et al. 2019, Sec. 3).
    assert tp[0].calls_per_step == 4 * m.layers * 4
    assert tp[0].size_bytes == m.seq * m.hidden * 2
    assert tp[0].group.n == 8 and tp[0].group.nodes == 1
    sp = step_communication(m, Layout(tp=8, sp=True, grad_accum=4), tr, cluster)
    sp_volume = sum(c.volume_bytes for c in sp if c.name.startswith("TP"))
    assert sp_volume == pytest.approx(tp[0].volume_bytes)  # same volume (Korthikanti 4.2.2)
    pp = step_communication(m, Layout(pp=2, grad_accum=4), tr, cluster)
    sends = [c for c in pp if c.op == "sendrecv"]
    assert sends and sends[0].calls_per_step == 2 * 4
