"""The planner's shapes of zoo models come from the zoo: its torch-free mirror of the gpt sizes
equals hpcml.models.gpt, and every zoo model built with torch has the parameters, parameter
tensors, FSDP2 units and saved activations the planner counts.

Saved activations are measured by hpcml.train.memprobe (saved-tensor hooks) and predicted by
plan.memory's formulas; the two share no code.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from hpcml.config import OptimConfig
from hpcml.distributed.wrapping import units
from hpcml.models import gpt
from hpcml.models.zoo import build_model, count_parameters, list_models
from hpcml.plan.memory import Layout, Training, per_device_bytes
from hpcml.plan.shapes import ZOO_GPT_DEFAULTS, ZOO_GPT_SIZES, model_shape
from hpcml.train.losses import cross_entropy
from hpcml.train.memprobe import SavedActivationProbe
from hpcml.train.schedule import param_groups


def test_mirror_equals_the_zoo() -> None:
    assert ZOO_GPT_SIZES == gpt.SIZES
    defaults = {f.name: f.default for f in dataclasses.fields(gpt.GPTConfig)}
    assert defaults == ZOO_GPT_DEFAULTS


@pytest.mark.parametrize("name", [s.name for s in list_models()])
def test_every_zoo_model_counts_as_built(name: str) -> None:
    with torch.device("meta"):  # gpt-1.3b would take 5 GB for real
        model = build_model(name, {})
    planned = model_shape(name)
    assert planned.params == count_parameters(model)
    assert planned.param_tensors == len(list(model.parameters()))
    if not planned.is_transformer:
        biggest = max(
            sum(p.numel() for p in getattr(parent, n).parameters()) for parent, n in units(model)
        )
        assert planned.largest_layer_params == biggest
    # One ZeRO-3 all-gather per wrapped unit, plus the root's when parameters are left there.
    found = units(model)
    in_units = sum(p.numel() for parent, n in found for p in getattr(parent, n).parameters())
    root = 1 if in_units < planned.params else 0
    assert planned.gather_units == len(found) + root
    # DDP broadcasts buffers (BatchNorm statistics) in one call per dtype before each forward.
    buffers = list(model.buffers())
    assert planned.buffer_groups == len({b.dtype for b in buffers})
    assert planned.buffer_bytes == sum(b.numel() * b.element_size() for b in buffers)


@pytest.mark.parametrize(
    "args",
    [
        {"mlp": "swiglu"},
        {"bias": False, "tie_embeddings": False},
        {
            "n_layer": 3,
            "d_model": 96,
            "n_head": 3,
            "mlp": "swiglu",
            "bias": False,
            "mlp_ratio": 3.0,
        },
    ],
)
def test_gpt_arguments_count_as_built(args: dict[str, object]) -> None:
    with torch.device("meta"):
        model = build_model("gpt-tiny", args)
    planned = model_shape("gpt-tiny", args)
    assert planned.params == count_parameters(model)
    assert planned.param_tensors == len(list(model.parameters()))


def _measure(name: str, args: dict[str, object], batch: int, eager: bool) -> tuple[int, int]:
    torch.manual_seed(0)
    model = build_model(name, args)
    if name.startswith("gpt"):
        seq = int(args.get("max_seq_len", 64))  # type: ignore[call-overload]
        x = torch.randint(0, 256, (batch, seq))
        y = torch.randint(0, 256, (batch, seq))
    else:
        x = torch.randn(batch, 3, 32, 32)
        y = torch.randint(0, 10, (batch,))
    probe = SavedActivationProbe(model)
    # MATH is PyTorch's eager attention (materialised softmax); FLASH is its fused CPU kernel.
    with sdpa_kernel(SDPBackend.MATH if eager else SDPBackend.FLASH_ATTENTION), probe.sample():
        loss = cross_entropy(model(x), y)
    loss.backward()
    r = probe.result(torch.device("cpu"))
    return int(r["saved_activation_bytes"]), int(r["saved_param_bytes"])


@pytest.mark.parametrize(
    "name,args,batch,eager",
    [
        ("gpt-tiny", {"max_seq_len": 64}, 8, False),
        ("gpt-tiny", {"max_seq_len": 64}, 8, True),
        ("gpt-tiny", {"max_seq_len": 64, "mlp": "swiglu"}, 4, False),
        ("gpt-tiny", {"n_layer": 4, "d_model": 128, "n_head": 4, "max_seq_len": 128}, 4, True),
        ("gpt-tiny", {"max_seq_len": 64, "bias": False, "tie_embeddings": False}, 4, False),
        ("mlp", {}, 16, False),
        ("simple_cnn", {}, 4, False),
    ],
)
def test_saved_activations_match_the_formulas(
    name: str, args: dict[str, object], batch: int, eager: bool
) -> None:
    measured, params_saved = _measure(name, args, batch, eager)
    shape = model_shape(name, args)
    layout = Layout(micro_batch=batch, attention="eager" if eager else None)
    predicted = per_device_bytes(shape, layout, Training("fp32"), 1).activations_bytes
    # The formulas leave out per-row statistics (LayerNorm mean and rstd: 8 bytes per token
    # and norm) and the int64 token ids and targets (16 bytes per token), about 0.6% of
    # gpt-tiny's ~9.8 kB per token; 2% bounds that with room.
    assert predicted == pytest.approx(measured, rel=0.02)
    assert params_saved > 0  # weights saved by Linear/Conv are kept apart as model states


def test_eager_attention_keeps_the_scores_and_sdpa_does_not() -> None:
    args = {"max_seq_len": 64}
    sdpa, _ = _measure("gpt-tiny", args, 8, False)
    eager, _ = _measure("gpt-tiny", args, 8, True)
    s, b, a, layers = 64, 8, 4, 2
    # The softmax output, a x s x s fp32 per layer and sample, less the log-sum-exp (a x s).
    assert eager - sdpa == pytest.approx(layers * b * a * (4 * s * s - 4 * s), rel=0.01)


def test_probe_counts_a_storage_once_and_parameters_apart() -> None:
    lin = torch.nn.Linear(8, 8, bias=False)
    probe = SavedActivationProbe(lin)
    x = torch.randn(4, 8, requires_grad=True)
    with probe.sample():
        y = lin(x)  # saves x and the weight
        z = (y * y).sum() + (y.view(32) * 2).sum()  # y saved twice, once through a view
    z.backward()
    r = probe.result(torch.device("cpu"))
    assert r["saved_activation_bytes"] == 4 * 8 * 4 * 2  # x and y, 128 bytes each
    assert r["saved_param_bytes"] == 8 * 8 * 4
    again = SavedActivationProbe(lin)
    with again.sample(active=False):
        lin(x).sum().backward()
    assert again.result(torch.device("cpu"))["saved_activation_bytes"] is None


@pytest.mark.parametrize(
    ("name", "args"),
    [(s.name, {}) for s in list_models()]
    + [("gpt-tiny", {"bias": False, "tie_embeddings": False, "mlp": "swiglu"})],
)
def test_tensor_sizes_are_the_optimizer_groups(name: str, args: dict[str, object]) -> None:
    """ZeRO-1 under torch partitions whole tensors group by group, so the planner's tensor
    sizes must be hpcml's two weight-decay groups exactly (as multisets: the partition sorts)."""
    with torch.device("meta"):
        model = build_model(name, dict(args))
    groups = param_groups(model, OptimConfig(name="adamw", lr=1e-3, weight_decay=0.1))
    built = [sorted(p.numel() for p in g["params"]) for g in groups]
    planned = [sorted(g) for g in model_shape(name, dict(args) or None).param_tensor_sizes]
    assert planned == built
