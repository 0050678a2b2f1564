"""Registry of model builders by name, plus user models by import path (`mypkg.models:build`).

An import path runs the user's code, so it is honoured only where the user opted in: in their
own training config or on their own command line (`trust_code=True`, the default for those
callers). A name read from a model file (an export's `model.json`, a registry artifact) is
data that someone else may have written; `hpcml.models.export` asks with `trust_code=False`,
and an import path there is refused unless the user passed `--trust-code`.

A spec knows its input shape so that `model info` can count FLOPs by running one forward pass
under torch's FlopCounterMode (counted, not guessed) and so that exports carry an input spec.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hpcml.errors import ModelError
from hpcml.models import gpt
from hpcml.models.cnn import MLP, SimpleCNN
from hpcml.models.resnet import resnet18


@dataclass(frozen=True)
class ModelSpec:
    name: str
    builder: Callable[..., nn.Module]
    input_shape: tuple[int, ...]
    """Per-sample input shape, e.g. (3, 32, 32)."""
    task: str = "classification"
    input_dtype: str = "float32"
    description: str = ""
    defaults: dict[str, Any] = field(default_factory=dict)
    input_shape_fn: Callable[[dict[str, Any]], tuple[int, ...]] | None = None
    complete_fn: Callable[[dict[str, Any], tuple[int, ...], int], dict[str, Any]] | None = None
    """Fills builder arguments from the data (e.g. vocabulary size and sequence length)."""
    train_flops_per_token_fn: Callable[[dict[str, Any]], int] | None = None
    """Analytic training FLOPs per token for language models (used for MFU)."""

    def shape_for(self, args: dict[str, Any]) -> tuple[int, ...]:
        return self.input_shape_fn(args) if self.input_shape_fn else self.input_shape


_REGISTRY: dict[str, ModelSpec] = {}


def register(spec: ModelSpec) -> ModelSpec:
    _REGISTRY[spec.name] = spec
    return spec


def _mlp_shape(args: dict[str, Any]) -> tuple[int, ...]:
    return tuple(args.get("input_shape", (3, 32, 32)))


def _build_mlp(input_shape: tuple[int, ...] | list[int] = (3, 32, 32), **kw: Any) -> nn.Module:
    n = 1
    for d in input_shape:
        n *= int(d)
    return MLP(in_features=n, **kw)


register(
    ModelSpec(
        "simple_cnn",
        SimpleCNN,
        (3, 32, 32),
        description="CIFAR-10 workshop SimpleCNN: 3 conv stages (64/128/256) + 2 linear layers",
    )
)
register(ModelSpec("resnet18", resnet18, (3, 32, 32), description="ResNet-18, CIFAR stem"))
register(
    ModelSpec(
        "mlp",
        _build_mlp,
        (3, 32, 32),
        description="multi-layer perceptron (no BatchNorm: data parallel is exact)",
        input_shape_fn=_mlp_shape,
    )
)


def _gpt_spec(size: str) -> ModelSpec:
    defaults = gpt.SIZES[size]

    def shape(args: dict[str, Any]) -> tuple[int, ...]:
        return (int({**defaults, **args}["max_seq_len"]),)

    def complete(
        args: dict[str, Any], input_shape: tuple[int, ...], num_classes: int
    ) -> dict[str, Any]:
        # Token data decides the vocabulary and the context the model must cover.
        return {"vocab_size": num_classes, "max_seq_len": int(input_shape[0]), **args}

    def flops(args: dict[str, Any]) -> int:
        return gpt.train_flops_per_token(gpt.config_of({**defaults, **args}))

    cfg = gpt.config_of(defaults)
    return ModelSpec(
        size,
        gpt.build_gpt,
        (cfg.max_seq_len,),
        task="language_modeling",
        input_dtype="int64",
        description=(
            f"decoder-only transformer: {cfg.n_layer} layers, d_model {cfg.d_model}, "
            f"{cfg.n_head} heads, context {cfg.max_seq_len}"
        ),
        defaults=dict(defaults),
        input_shape_fn=shape,
        complete_fn=complete,
        train_flops_per_token_fn=flops,
    )


for _size in gpt.SIZES:
    register(_gpt_spec(_size))


def list_models() -> list[ModelSpec]:
    return [_REGISTRY[k] for k in sorted(_REGISTRY)]


def _import_builder(path: str) -> Callable[..., nn.Module]:
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ModelError(
            f"model {path!r}: module {module_name!r} cannot be imported ({exc}); "
            "check model.name and that the package is on PYTHONPATH."
        ) from None
    builder = getattr(module, attr, None)
    if builder is None or not callable(builder):
        raise ModelError(
            f"model {path!r}: module {module_name!r} has no callable '{attr}'; "
            "point model.name at a function that returns an nn.Module."
        )
    return builder  # type: ignore[no-any-return]


class UntrustedCode(ModelError):
    """An import path where only zoo names are accepted (no `--trust-code`)."""


def is_import_path(name: str) -> bool:
    return ":" in name


def get_spec(name: str, *, trust_code: bool = True) -> ModelSpec:
    if is_import_path(name):
        if not trust_code:
            raise UntrustedCode(
                f"model {name!r} is an import path, and code named by a model file runs only "
                "with --trust-code; pass it if you trust whoever wrote the file, or export "
                "with a zoo architecture."
            )
        builder = _import_builder(name)
        shape = tuple(getattr(builder, "input_shape", (3, 32, 32)))
        return ModelSpec(name, builder, shape, description="user model")
    spec = _REGISTRY.get(name)
    if spec is None:
        known = ", ".join(sorted(_REGISTRY))
        raise ModelError(
            f"model {name!r} is not in the zoo; known models are: {known} "
            "(or give an import path like mypkg.models:build)."
        )
    return spec


def build_model(
    name: str, args: dict[str, Any] | None = None, *, trust_code: bool = True
) -> nn.Module:
    spec = get_spec(name, trust_code=trust_code)
    kwargs = {**spec.defaults, **(args or {})}
    try:
        model = spec.builder(**kwargs)
    except (TypeError, ValueError, RuntimeError, ZeroDivisionError, AssertionError) as exc:
        # A wrong name, a negative size, a head count that does not divide the width: the
        # builder (ours or torch's layers) says what, the user needs to know where.
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelError(
            f"model {name!r} cannot be built with arguments {kwargs} ({reason}); "
            "check model.args against the builder's parameters (`hpcml model info "
            f"{name}`)."
        ) from None
    if not isinstance(model, nn.Module):
        raise ModelError(
            f"model {name!r}: the builder returned {type(model).__name__}, not nn.Module."
        )
    return model


def complete_args(
    name: str, args: dict[str, Any], input_shape: tuple[int, ...], num_classes: int
) -> dict[str, Any]:
    """Fill `num_classes` / `input_shape` from the data when the builder takes them and the
    config does not set them, so one model config works on several data sources."""
    import inspect

    spec = get_spec(name)
    if spec.complete_fn is not None:
        return spec.complete_fn(dict(args), input_shape, num_classes)
    try:
        params = inspect.signature(spec.builder).parameters
    except (TypeError, ValueError):
        return dict(args)
    out = dict(args)
    if "num_classes" in params and "num_classes" not in out:
        out["num_classes"] = num_classes
    if "input_shape" in params and "input_shape" not in out:
        out["input_shape"] = list(input_shape)
    if "in_channels" in params and "in_channels" not in out and len(input_shape) == 3:
        out["in_channels"] = input_shape[0]
    return out


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def forward_flops_per_sample(
    model: nn.Module,
    input_shape: tuple[int, ...],
    dtype: str = "float32",
    device: str | torch.device = "cpu",
) -> int:
    """FLOPs of one forward pass for one sample, counted by torch's FlopCounterMode.

    Convention: a multiply-add counts as 2 FLOPs (as in torch.utils.flop_counter and the
    Megatron/PaLM accounting); elementwise ops are not counted.
    """
    from torch.utils.flop_counter import FlopCounterMode

    was_training = model.training
    model.eval()
    if dtype.startswith("int"):
        x = torch.zeros((2, *input_shape), dtype=getattr(torch, dtype), device=device)
    else:
        x = torch.randn((2, *input_shape), device=device)
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        model(x)
    model.train(was_training)
    return int(counter.get_total_flops()) // 2
