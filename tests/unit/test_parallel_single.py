"""Parallel wrapping pieces that run in one process: units, activation checkpointing, clipping,
full state dicts, and the checks that refuse impossible layouts before any collective."""

from __future__ import annotations

import pytest
import torch

from hpcml.config import ParallelConfig, TrainConfig
from hpcml.distributed.parallel import clip_grad_norm, full_state_dict, parallelize
from hpcml.distributed.runtime import Runtime
from hpcml.distributed.wrapping import units
from hpcml.errors import ConfigError
from hpcml.models.zoo import build_model
from hpcml.train.losses import cross_entropy


def _rt(world: int = 1, tp: int = 1) -> Runtime:
    return Runtime(0, 0, world, world, torch.device("cpu"), None, tp)


def test_units_per_model() -> None:
    kinds = {
        name: [type(getattr(p, n)).__name__ for p, n in units(build_model(name, {}))]
        for name in ("gpt-tiny", "resnet18", "simple_cnn")
    }
    assert kinds["gpt-tiny"] == ["Block", "Block"]
    assert kinds["resnet18"].count("BasicBlock") == 8
    assert kinds["simple_cnn"] == ["Sequential"] * 4  # three conv stages + the classifier


def _grads(mode: str) -> tuple[list[str], list[torch.Tensor], float]:
    torch.manual_seed(0)
    model = build_model("gpt-tiny", {"n_layer": 4})
    model = parallelize(
        model, _rt(), ParallelConfig(), TrainConfig(activation_checkpointing=mode, ac_every=2)
    )
    idx = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    loss = cross_entropy(model(idx[:, :-1]), idx[:, 1:])
    loss.backward()
    return list(full_state_dict(model)), [p.grad for p in model.parameters()], loss.item()


@pytest.mark.parametrize("mode", ["full", "selective", "layer:3", "op"])
def test_activation_checkpointing_keeps_names_and_gradients(mode: str) -> None:
    names0, grads0, loss0 = _grads("none")
    names1, grads1, loss1 = _grads(mode)
    assert names1 == names0  # exports and checkpoints stay interchangeable
    assert loss1 == loss0
    # Recomputation runs the same kernels on the same shapes (the loss is bit-equal): 1e-7 only
    # lets a shared weight's gradient terms add in another order (one rounding of |g| < 1).
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(grads0, grads1, strict=True))


def test_selective_wraps_every_kth_block() -> None:
    model = build_model("gpt-tiny", {"n_layer": 4})
    parallelize(model, _rt(), ParallelConfig(), TrainConfig(activation_checkpointing="selective"))
    wrapped = [type(b).__name__ == "CheckpointWrapper" for b in model.blocks]
    assert wrapped == [True, False, True, False]


def test_layer_k_wraps_every_kth_block_from_the_first() -> None:
    model = build_model("gpt-tiny", {"n_layer": 4})
    parallelize(model, _rt(), ParallelConfig(), TrainConfig(activation_checkpointing="layer:3"))
    wrapped = [type(b).__name__ == "CheckpointWrapper" for b in model.blocks]
    assert wrapped == [True, False, False, True]


@pytest.mark.parametrize(
    "policy,needle",
    [("attention-scores", "only eager attention keeps"), ("layer:0", "layer:K"), ("sel", "op")],
)
def test_unknown_or_meaningless_policies_are_refused(policy: str, needle: str) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=needle):
        TrainConfig(activation_checkpointing=policy)


def test_clip_grad_norm_matches_torch() -> None:
    torch.manual_seed(0)
    a = build_model("gpt-tiny", {})
    b = build_model("gpt-tiny", {})
    b.load_state_dict(a.state_dict())
    x = torch.randint(0, 256, (2, 16))
    for m in (a, b):
        cross_entropy(m(x), x).backward()
    ours = clip_grad_norm(a, 0.1)
    theirs = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.1)
    # Both take per-tensor 2-norms (pairwise sums, <= log2(n) u ~ 1e-6) and combine them.
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-5)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        # Clipped |g| <= 0.1: 1e-8 allows the clip coefficients to differ by ~10 ulps.
        assert torch.allclose(pa.grad, pb.grad, atol=1e-8)


def test_tp_needs_a_family_plan() -> None:
    with pytest.raises(ConfigError, match="tensor-parallel plan"):
        parallelize(build_model("simple_cnn", {}), _rt(2, 2), ParallelConfig(tp=2))


def test_tp_with_ddp_replicas_is_refused() -> None:
    with pytest.raises(ConfigError, match="zero2, zero3 or fsdp"):
        parallelize(build_model("gpt-tiny", {}), _rt(4, 2), ParallelConfig(tp=2))


def test_fp16_with_tp_is_refused() -> None:
    with pytest.raises(ConfigError, match="bf16"):
        parallelize(build_model("gpt-tiny", {}), _rt(2, 2), ParallelConfig(tp=2), precision="fp16")


def test_sequence_parallel_needs_tp() -> None:
    with pytest.raises(ConfigError, match="tp > 1"):
        parallelize(build_model("gpt-tiny", {}), _rt(), ParallelConfig(sequence_parallel=True))


def test_tp_must_divide_world() -> None:
    from hpcml.distributed.runtime import init_runtime

    with pytest.raises(ConfigError, match="does not divide"):
        init_runtime("cpu", tp=2)
