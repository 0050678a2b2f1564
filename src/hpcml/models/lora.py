"""LoRA adapters on hpcml models through Hugging Face PEFT (Hu et al. 2021).

`inject` puts PEFT's LoRA layers in place on the target modules of a model (it keeps its class,
so activation checkpointing, compile and the data-parallel wrappers see the same blocks) and
freezes everything else. Parameter names gain PEFT's parts: `blocks.0.attn.wq.weight` becomes
`blocks.0.attn.wq.base_layer.weight`, beside `...wq.lora_A.default.weight` and `lora_B`.
`merged_state` turns such a state dict back into the base's names with the scaled adapter
added to each base weight (PEFT's `merge_and_unload`), so the result is an ordinary export.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hpcml.errors import ConfigError

ADAPTER = "default"
GPT_TARGETS = ["wq", "wk", "wv", "wo"]


def default_targets(model: nn.Module) -> list[str]:
    """The attention projections of a gpt (its lm_head shares the token embedding and is left
    alone); every Linear and Conv2d of other models (the CNNs, the MLP)."""
    if getattr(model, "family", None) == "gpt":
        return list(GPT_TARGETS)
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear | nn.Conv2d)]


def lora_config(r: int, alpha: float, dropout: float, targets: list[str]) -> Any:
    from peft import LoraConfig

    # peft annotates lora_alpha as int but only divides it by r: a float is taken as given.
    return LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets  # type: ignore[arg-type]
    )


def matched_modules(model: nn.Module, config: Any) -> list[str]:
    """Names of the modules of `model` PEFT would give adapters (nothing is changed)."""
    from peft.tuners.tuners_utils import check_target_module_exists

    return [n for n, _ in model.named_modules() if n and check_target_module_exists(config, n)]


def check_targets(model: nn.Module, config: Any, where: str = "finetune.target") -> list[str]:
    """The matched module names; a pattern that matches nothing, or a match that is not a
    Linear or Conv2d, is refused in one sentence."""
    names = matched_modules(model, config)
    adaptable = [n for n, m in model.named_modules() if isinstance(m, nn.Linear | nn.Conv2d)]
    for pattern in config.target_modules:
        if not any(n == pattern or n.endswith("." + pattern) for n in names):
            raise ConfigError(
                f"{where} '{pattern}' matches no module of this model; name Linear or Conv2d "
                f"modules by their full name or its last part, e.g. {', '.join(adaptable[:4])}."
            )
    modules = dict(model.named_modules())
    for n in names:
        if not isinstance(modules[n], nn.Linear | nn.Conv2d):
            raise ConfigError(
                f"{where} matches '{n}', a {type(modules[n]).__name__}; LoRA adapts Linear and "
                "Conv2d modules only, so name those."
            )
    return names


def inject(model: nn.Module, config: Any, seed: int) -> nn.Module:
    """Put LoRA layers on the targets in place (A from a generator seeded by `seed`, so every
    rank draws the same; B zero, so the model starts as the base) and freeze the base."""
    from peft import inject_adapter_in_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
    return model


def merged_state(
    build: Callable[[], nn.Module], config: Any, state: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The base's state dict with the adapters of `state` (an injected model's full state
    dict) merged in: W + (alpha / r) B A, by PEFT, on a fresh CPU copy of the model."""
    from peft.tuners.lora import LoraModel

    wrapper = LoraModel(build(), config, ADAPTER)
    wrapper.model.load_state_dict(state, strict=True)
    merged = wrapper.merge_and_unload()
    return {k: v.detach() for k, v in merged.state_dict().items()}


def adapter_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter tensors of an injected model's state dict under the names PEFT saves them
    (`base_model.model.` + module path, no adapter name), as `PeftModel.from_pretrained` reads
    them."""
    return {
        "base_model.model." + k.replace(f".{ADAPTER}.", "."): v.contiguous()
        for k, v in state.items()
        if ".lora_" in k
    }


def save_adapter(out_dir: Path, config: Any, state: dict[str, torch.Tensor]) -> Path:
    """`adapter_model.safetensors` and `adapter_config.json`, PEFT's file names."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(adapter_state(state), str(out_dir / "adapter_model.safetensors"))
    config.save_pretrained(str(out_dir))
    return out_dir
