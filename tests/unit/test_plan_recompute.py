"""Recomputation policies by the stacks' names (hpcml.plan.recompute), shared by `hpcml plan
--recompute` and `train.activation_checkpointing`: the planner's formula for each policy against
the same policy as `hpcml train` applies it (hpcml.distributed.wrapping.apply_ac), traced on fake
tensors under torch's MemTracker; `selective` refused in the planner as ambiguous,
`attention-scores` refused with fused attention; the Llama-2-70B recipe torchtitan runs with
selective op checkpointing fits with `op`."""

from __future__ import annotations

import pytest
import torch

from hpcml.distributed.wrapping import apply_ac
from hpcml.models.memtrace import trace_step
from hpcml.models.zoo import build_model
from hpcml.plan.activations import activation_bytes_per_layer
from hpcml.plan.common import PlanError
from hpcml.plan.hardware import load_catalog
from hpcml.plan.memory import Layout, Training, per_device_bytes, transformer_activation_bytes
from hpcml.plan.shapes import model_shape, zoo_gpt_shape
from hpcml.train.losses import cross_entropy

ARGS = {"n_layer": 4, "d_model": 256, "n_head": 4, "vocab_size": 256, "max_seq_len": 128}
BATCH, SEQ = 2, 128


def _traced_activations(policy: str) -> int:
    def build() -> torch.nn.Module:
        model = build_model("gpt-tiny", ARGS)
        apply_ac(model, policy, 2)
        return model.train()

    def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
        ids = torch.zeros(BATCH, SEQ, dtype=torch.int64)  # made under the fake mode
        return [(ids, ids)]

    traced = trace_step(
        build, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), batches, cross_entropy
    )
    return traced.activation_peak_bytes


@pytest.mark.parametrize("policy", ["none", "op", "layer:2", "full"])
def test_policy_formula_matches_the_policy_training_runs(policy: str) -> None:
    shape = zoo_gpt_shape("gpt-tiny", ARGS)
    layout = Layout(micro_batch=BATCH, recompute=policy)
    predicted = transformer_activation_bytes(shape, layout, 4)
    if policy != "none":  # the block recomputed in backward: not alive at the end of forward
        predicted -= activation_bytes_per_layer(
            SEQ,
            BATCH,
            shape.hidden,
            shape.heads,
            act_bytes=4,
            dropout=False,
            ffn_hidden=shape.ffn_hidden,
            attention="sdpa",
        )
    traced = _traced_activations(policy)
    print(f"{policy}: predicted {predicted:,.0f} B, traced {traced:,} B")
    # 10%: the planner's memory goal (hpcml.plan.check.MEMORY_GOAL).
    assert predicted / traced == pytest.approx(1, abs=0.10), (predicted, traced)


@pytest.mark.parametrize(
    "recompute,needle",
    [
        ("selective", "names three different policies"),
        ("attention-scores", "only eager attention keeps"),
        ("layer:0", "at least 1"),
        ("some", "not known"),
    ],
)
def test_ambiguous_or_meaningless_policies_are_refused(recompute: str, needle: str) -> None:
    with pytest.raises(PlanError, match=needle):
        per_device_bytes(model_shape("llama-7b"), Layout(recompute=recompute), Training(), 8)


def test_attention_scores_with_eager_attention_drops_the_scores() -> None:
    shape = model_shape("llama-7b")
    eager = Layout(attention="eager")
    none = per_device_bytes(shape, eager, Training(), 8).activations_bytes
    scores = per_device_bytes(
        shape, Layout(attention="eager", recompute="attention-scores"), Training(), 8
    ).activations_bytes
    fused = per_device_bytes(shape, Layout(attention="flash"), Training(), 8).activations_bytes
    assert scores < none and scores == pytest.approx(fused, rel=0.01)


def test_torchtitans_llama2_70b_recipe_fits_with_op_not_without() -> None:
    # torchtitan's Llama-2-70B recipe: 64 A100-80GB, FSDP (ZeRO-3, fp32 sharded parameters under
    # bf16 compute), micro-batch 1, selective op activation checkpointing; it runs.
    a100 = load_catalog().accelerator("a100-80gb").memory_bytes

    def plan(recompute: str) -> object:
        return per_device_bytes(
            model_shape("llama-70b"),
            Layout(zero=3, recompute=recompute),
            Training("bf16", weights="amp"),
            64,
            a100,
        )

    assert plan("op").fits()  # type: ignore[attr-defined]
    assert not plan("none").fits()  # type: ignore[attr-defined]
