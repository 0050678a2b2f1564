"""privacy.dp_sgd's refusals (one sentence each, before training) and its accountant: a run
given a target epsilon spends at most that (and nearly all of it) over train.max_steps; a
resumed run counts on from the checkpoint's history; MLflow gets the last epsilon of a window."""

from __future__ import annotations

import pytest
import torch

from hpcml.config import RunConfig
from hpcml.errors import ConfigError
from hpcml.models.zoo import build_model
from hpcml.track.mlflow import reduce_window
from hpcml.train import privacy

DP = {"noise_multiplier": 1.0, "max_grad_norm": 1.0}


def _cfg(**sections: object) -> RunConfig:
    return RunConfig.model_validate({"privacy": {"dp_sgd": DP}, **sections})


MLP = build_model("mlp", {"hidden": 8, "depth": 1})


@pytest.mark.parametrize(
    ("sections", "named"),
    [
        ({"parallel": {"strategy": "fsdp"}}, "parallel.strategy=fsdp"),
        ({"parallel": {"strategy": "zero1"}}, "parallel.strategy=zero1"),
        ({"parallel": {"tp": 2}}, "parallel.tp=2"),
        ({"parallel": {"pp": 2}}, "parallel.pp=2"),
        ({"precision": "bf16"}, "precision=bf16"),
        ({"optim": {"grad_clip": 1.0}}, "optim.grad_clip"),
        ({"train": {"grad_accum": 2}}, "2 micro-batches per step"),
        ({"train": {"compile": True}}, "train.compile=true"),
        ({"data": {"mixup_alpha": 0.2}}, "mixup or cutmix"),
    ],
)
def test_what_opacus_cannot_train_is_refused(sections: dict, named: str) -> None:
    cfg = _cfg(**sections)
    with pytest.raises(ConfigError, match="privacy.dp_sgd cannot train this run") as err:
        privacy.check(cfg, MLP, cfg.train.grad_accum)
    assert named in err.value.message and "\n" not in err.value.message
    privacy.check(RunConfig.model_validate(sections), MLP, 1)  # without DP-SGD: no refusal


def test_batchnorm_is_refused_with_the_model_named() -> None:
    with torch.device("meta"):
        cnn = build_model("simple_cnn", {})
    with pytest.raises(ConfigError, match="per-sample gradients of model simple_cnn"):
        privacy.check(_cfg(model={"name": "simple_cnn"}), cnn, 1)


def test_noise_or_target_exactly_one() -> None:
    for dp in ({"max_grad_norm": 1.0}, {"noise_multiplier": 1.0, "target_epsilon": 3.0}):
        with pytest.raises(ValueError, match="exactly one of noise_multiplier and target_epsilon"):
            RunConfig.model_validate({"privacy": {"dp_sgd": dp}})


def test_a_target_epsilon_is_spent_by_the_last_step_and_restored_on_resume() -> None:
    target, steps = 2.0, 50
    cfg = RunConfig.model_validate(
        {"privacy": {"dp_sgd": {"target_epsilon": target}}, "train": {"max_steps": steps}}
    )
    model = build_model("mlp", {"hidden": 8, "depth": 1})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dp_opt, acct = privacy.attach(model, opt, cfg, per_rank_batch=64, world_size=1,
                                  train_samples=1000)  # fmt: skip
    assert acct is not None and privacy.state_optimizer(dp_opt) is opt
    assert acct.sample_rate == 64 / 1000
    eps = [acct.step()["epsilon"] for _ in range(steps)]
    # get_noise_multiplier searches to within 0.01 of the target (its epsilon_tolerance).
    assert target - 0.011 <= eps[-1] <= target and eps == sorted(eps)

    other = build_model("mlp", {"hidden": 8, "depth": 1})
    fresh = privacy.attach(other, torch.optim.SGD(other.parameters(), lr=0.1), cfg, 64, 1, 1000)[1]
    assert fresh is not None
    fresh.restore(acct.state())  # a resume: the checkpoint's 50 steps count on
    assert fresh.epsilon() == eps[-1]
    fresh.restore({"history": [[acct.noise_multiplier, 0.064, 10]]})  # an older one: kept 50
    assert fresh.epsilon() == eps[-1]


def test_mlflow_gets_the_privacy_spent_at_the_end_of_a_window() -> None:
    window = [{"step": i, "loss": 1.0, "epsilon": 0.1 * i} for i in (1, 2, 3)]
    assert reduce_window(window)["epsilon"] == pytest.approx(0.3)


def _one_private_step(noise: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight change of one SGD step with lr 1, the batch) under DP-SGD, max_grad_norm 0.5."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(100, 100)
    cfg = RunConfig.model_validate(
        {"privacy": {"dp_sgd": {"noise_multiplier": noise, "max_grad_norm": 0.5}}}
    )
    before = model.weight.detach().clone()
    opt, _ = privacy.attach(model, torch.optim.SGD(model.parameters(), lr=1.0), cfg, 8, 1, 80)
    x = torch.randn(8, 100, generator=torch.Generator().manual_seed(1))
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
    return model.weight.detach() - before, x


def test_one_step_clips_each_sample_and_adds_noise_of_the_configured_scale() -> None:
    change, x = _one_private_step(noise=0.0)
    # By hand: each sample's gradient (weight and bias together) scaled to norm <= 0.5, summed,
    # divided by the batch; SGD with lr 1 moves the weight by minus that.
    torch.manual_seed(0)
    ref = torch.nn.Linear(100, 100)
    clipped = torch.zeros_like(ref.weight)
    for i in range(8):
        ref.zero_grad()
        ref(x[i : i + 1]).pow(2).mean().backward()
        norm = torch.sqrt(ref.weight.grad.pow(2).sum() + ref.bias.grad.pow(2).sum())
        clipped += ref.weight.grad * min(1.0, 0.5 / (float(norm) + 1e-6))
        assert float(norm) > 0.5  # every sample is clipped: the test sees the clipping
    # fp32 sums of 8 terms in another order: ~1e-7 of values ~1e-2.
    torch.testing.assert_close(change, -clipped / 8, rtol=1e-5, atol=1e-7)
    noisy, _ = _one_private_step(noise=2.0)
    # The noise on the averaged gradient has std noise x max_grad_norm / batch = 0.125; over
    # 10,000 weights the sample std is within 2% of it (its relative error is ~0.7%).
    assert float((noisy - change).std()) == pytest.approx(2.0 * 0.5 / 8, rel=0.02)
