"""ZeRO-1 as torch's ZeroRedundancyOptimizer partitions it (whole tensors, largest first, to
the rank with the fewest elements) next to the ZeRO paper's even split.

The 2-process check against torch's real partition is
tests/integration/test_plan_memprobe_dist.py::test_zero1_state_is_whole_tensors_per_rank.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from hpcml.plan.check import setup_from_summary
from hpcml.plan.hardware import load_catalog
from hpcml.plan.memory import Layout, Training, per_device_bytes
from hpcml.plan.shapes import model_shape
from hpcml.plan.zero1 import busiest_rank_optimizer_bytes, tensor_partition


def test_greedy_by_hand() -> None:
    # Worked by hand: 10 -> r0; 6 -> r1; 5 -> r1 (6 < 10); 1 -> r0 (10 < 11); then the second
    # group starts from those sizes: 3 -> r0 (11 = 11, tie to the lower rank), 2 -> r1.
    assert tensor_partition([[6, 10, 1, 5], [2, 3]], 2) == [(14, 3), (13, 3)]
    # Per tensor state counts too: 4 bytes per element plus 100 per tensor.
    assert busiest_rank_optimizer_bytes([[6, 10, 1, 5], [2, 3]], 2, 4, 100) == (356.0, 14)
    assert tensor_partition([[7]], 3) == [(7, 1), (0, 0), (0, 0)]


def test_mlp_busiest_rank_holds_its_first_layer() -> None:
    """The zoo MLP's 3072x256 weight is 92% of its 855,050 parameters: under torch's ZeRO-1
    one rank holds its AdamW state alone (8 bytes per element + a 4-byte step), as the
    2-process runs measured (6,291,460 bytes); the even split predicts 3,420,212."""
    mlp = model_shape("mlp")
    one = (tuple(n for g in mlp.param_tensor_sizes for n in g),)
    mlp = replace(mlp, param_tensor_sizes=one)
    fp32 = Training("fp32")
    torch_zero1 = per_device_bytes(mlp, Layout(zero=1, zero1_whole_tensors=True), fp32, 2)
    assert torch_zero1.optimizer_bytes == 786_432 * 8 + 4
    # The foreach step's temporary is as big as the busiest rank's share of one state.
    assert torch_zero1.optimizer_temp_bytes == 786_432 * 4
    paper = per_device_bytes(mlp, Layout(zero=1), fp32, 2)
    assert paper.optimizer_bytes == (855_050 * 8 + 6 * 4) / 2


def test_without_tensor_sizes_the_even_split_is_kept_and_said() -> None:
    m = model_shape("llama-7b")
    mem = per_device_bytes(m, Layout(zero=1, zero1_whole_tensors=True), Training("bf16"), 8)
    even = per_device_bytes(m, Layout(zero=1), Training("bf16"), 8)
    assert mem.optimizer_bytes == even.optimizer_bytes
    assert any("ZeroRedundancyOptimizer" in n for n in mem.notes)


def _summary(decay: float, strategy: str = "zero1") -> dict[str, object]:
    return {
        "world_size": 2,
        "device": {"type": "cpu", "name": "cpu"},
        "precision": "fp32",
        "config": {
            "model": {"name": "gpt-tiny", "args": {}},
            "data": {"batch_size": 2},
            "parallel": {"strategy": strategy},
            "optim": {"name": "adamw", "weight_decay": decay},
        },
        "model": {"name": "gpt-tiny", "args": {}},
    }


@pytest.mark.parametrize(
    ("decay", "busiest"),
    # gpt-tiny's 36 tensors; one group: 61,440 elements in 6 tensors on rank 0; hpcml's two
    # weight-decay groups (decayed matrices first): 65,536 in 7 (tensor_partition above).
    [(0.0, 61_440 * 8 + 6 * 4), (0.1, 65_536 * 8 + 7 * 4)],
)
def test_run_config_picks_torch_partition_and_groups(decay: float, busiest: int) -> None:
    setup = setup_from_summary(_summary(decay), load_catalog())
    assert setup.layout.zero1_whole_tensors
    mem = per_device_bytes(setup.model, setup.layout, setup.training, 2)
    assert mem.optimizer_bytes == busiest
    ddp = setup_from_summary(_summary(decay, "ddp"), load_catalog())
    assert not ddp.layout.zero1_whole_tensors
