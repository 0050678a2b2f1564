"""Optimizer parameter groups (issue 10, item 8) and `train.global_batch` arithmetic (item 5)."""

from __future__ import annotations

import pytest
import torch

from hpcml.config import OptimConfig, RunConfig
from hpcml.errors import ConfigError
from hpcml.models.zoo import build_model
from hpcml.train.schedule import build_optimizer, param_groups
from hpcml.train.validate import derive_grad_accum


def step_with_zero_gradients(model: torch.nn.Module, cfg: OptimConfig) -> dict[str, torch.Tensor]:
    """One AdamW step with all gradients zero: Adam's own update is 0/(0 + eps) = 0, so any
    change is the decoupled weight decay p <- p (1 - lr wd) alone."""
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = build_optimizer(param_groups(model, cfg), cfg, 1)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    return before


@pytest.mark.parametrize("name", ["gpt-tiny", "simple_cnn"])
def test_norms_biases_embeddings_are_not_decayed(name: str) -> None:
    torch.manual_seed(0)
    model = build_model(name)
    cfg = OptimConfig(lr=0.1, weight_decay=0.5)
    before = step_with_zero_gradients(model, cfg)
    shrink = 1 - 0.1 * 0.5
    exempt = ("norm", "emb.", "bias", "features.0.1", "features.1.1", "features.2.1")
    decayed = 0
    for k, p in model.named_parameters():
        if any(e in k for e in exempt):
            assert torch.equal(p, before[k]), k  # norms, biases, embeddings untouched
        else:
            # One multiply in fp32: within 1 ulp-ish (2^-23 relative) of the exact product.
            torch.testing.assert_close(p, before[k] * shrink, rtol=1.2e-7, atol=0), k
            decayed += 1
    assert decayed >= 3
    if name == "gpt-tiny":  # the head is tied to the token table, an embedding: not decayed
        assert model.lm_head.weight is model.emb.tok.weight  # type: ignore[union-attr]


def test_everything_decays_when_asked_and_fused_kernel_kept() -> None:
    torch.manual_seed(0)
    model = build_model("gpt-tiny")
    cfg = OptimConfig(lr=0.1, weight_decay=0.5, decay_norms_biases_embeddings=True)
    before = step_with_zero_gradients(model, cfg)
    tok = model.emb.tok.weight  # type: ignore[union-attr]
    torch.testing.assert_close(tok, before["emb.tok.weight"] * 0.95, rtol=1.2e-7, atol=0)
    groups = param_groups(model, OptimConfig(weight_decay=0.5))
    assert [g["weight_decay"] for g in build_optimizer(groups, cfg, 1).param_groups] == [0.5, 0.0]
    assert build_optimizer(groups, cfg, 1).defaults["fused"] is True  # groups of plain tensors
    # No decay at all: one plain list, as checkpoints of earlier runs hold one group.
    assert isinstance(param_groups(model, OptimConfig())[0], torch.nn.Parameter)


def config(**train: object) -> RunConfig:
    return RunConfig.model_validate({"data": {"batch_size": 8}, "train": train})


def test_global_batch_derives_grad_accum() -> None:
    assert derive_grad_accum(config(global_batch=32), 2) == 2
    assert derive_grad_accum(config(global_batch=32), 1) == 4
    assert derive_grad_accum(config(grad_accum=3), 2) == 3  # no global_batch: as configured
    assert derive_grad_accum(config(global_batch=32, grad_accum=4), 1) == 4  # agrees: fine


@pytest.mark.parametrize(
    "train,dp,needle",
    [
        ({"global_batch": 32}, 3, "not a multiple of data.batch_size 8 x 3"),
        ({"global_batch": 32, "grad_accum": 3}, 2, "train.grad_accum 3 contradicts"),
    ],
)
def test_global_batch_refusals(train: dict[str, int], dp: int, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        derive_grad_accum(config(**train), dp)
