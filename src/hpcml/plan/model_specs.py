"""Published model shapes the planner knows by name: the transformer specs (layers, hidden size,
heads, sequence, the rest of `hpcml.plan.shapes.transformer`'s arguments, each with its source)
and the zoo's gpt sizes. Data only, kept apart from the formulas in `hpcml.plan.shapes`."""

from __future__ import annotations

from typing import Any

LLAMA_STYLE = {
    "gated_mlp": True,
    "tied_embeddings": False,
    "learned_positions": False,
    "biases": False,
    "dropout": False,
}

# name -> (layers, hidden, heads, seq, extra keyword arguments of `transformer`)
TRANSFORMER_SPECS: dict[str, tuple[int, int, int, int, dict[str, Any]]] = {
    "gpt3-175b": (
        96,
        12288,
        96,
        2048,
        {"vocab": 50257, "source": "GPT-3 (Brown et al. 2020, Table 2.1)"},
    ),
    "llama-7b": (
        32,
        4096,
        32,
        4096,
        {
            **LLAMA_STYLE,
            "ffn_hidden": 11008,
            "vocab": 32000,
            "source": "Llama 2 7B (Touvron et al. 2023)",
        },
    ),
    "llama-13b": (
        40,
        5120,
        40,
        4096,
        {
            **LLAMA_STYLE,
            "ffn_hidden": 13824,
            "vocab": 32000,
            "source": "Llama 2 13B (Touvron et al. 2023)",
        },
    ),
    "llama-70b": (
        80,
        8192,
        64,
        4096,
        {
            **LLAMA_STYLE,
            "ffn_hidden": 28672,
            "vocab": 32000,
            "kv_heads": 8,
            "source": "Llama 2 70B (Touvron et al. 2023)",
        },
    ),
    "llama3-8b": (
        32,
        4096,
        32,
        8192,
        {
            **LLAMA_STYLE,
            "ffn_hidden": 14336,
            "vocab": 128256,
            "kv_heads": 8,
            "source": "Llama 3 8B (Dubey et al. 2024)",
        },
    ),
    "llama3-70b": (
        80,
        8192,
        64,
        8192,
        {
            **LLAMA_STYLE,
            "ffn_hidden": 28672,
            "vocab": 128256,
            "kv_heads": 8,
            "source": "Llama 3 70B (Dubey et al. 2024)",
        },
    ),
}

# The zoo's gpt models (hpcml.models.gpt: GPTConfig defaults and SIZES), mirrored because plan
# imports no torch. tests/unit/test_plan_zoo_shapes.py builds every zoo model and checks these
# numbers, the parameter counts and the saved activations against it.
ZOO_GPT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 256,
    "max_seq_len": 256,
    "n_layer": 2,
    "n_head": 4,
    "d_model": 64,
    "mlp": "gelu",
    "mlp_ratio": 4.0,
    "dropout": 0.0,
    "bias": True,
    "tie_embeddings": True,
    "vocab_multiple": 64,
}
ZOO_GPT_SIZES: dict[str, dict[str, Any]] = {
    "gpt-tiny": {"vocab_size": 256, "max_seq_len": 64, "n_layer": 2, "n_head": 4, "d_model": 64},
    "gpt2-small": {
        "vocab_size": 50257,
        "max_seq_len": 1024,
        "n_layer": 12,
        "n_head": 12,
        "d_model": 768,
    },
    "gpt-350m": {
        "vocab_size": 50257,
        "max_seq_len": 1024,
        "n_layer": 24,
        "n_head": 16,
        "d_model": 1024,
    },
    "gpt-1.3b": {
        "vocab_size": 50257,
        "max_seq_len": 2048,
        "n_layer": 24,
        "n_head": 16,
        "d_model": 2048,
    },
}
