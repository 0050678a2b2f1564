"""GPT-2-shaped weights from a local Hugging Face folder (`config.json` + `model.safetensors`)
into the zoo's `gpt`, whose architecture is GPT-2's: pre-norm blocks, LayerNorm (eps 1e-5),
tanh-approximated GELU, learned positions, tied input and output embeddings, biases.

Why by hand: the mapping is a renaming plus two facts no library states for us. Hugging
Face's GPT-2 keeps its linear layers as `Conv1D` with weights stored (in, out), the transpose
of `nn.Linear`'s (out, in), and fuses q, k and v into one `c_attn` of width 3 x d_model. The
weights are read with `safetensors` (tensors only: nothing in the file is executed or
unpickled) and the config with `json`; `transformers` is not needed to import, only to check
(tests/unit/test_hf_gpt2.py compares logits with its GPT2LMHeadModel).

Refused with one sentence each: a config that is not GPT-2's (`model_type`), an activation
other than tanh-GELU, another LayerNorm epsilon, the attention variants hpcml's block does not
have (`scale_attn_by_inverse_layer_idx`, `reorder_and_upcast_attn`, unscaled attention), untied
embeddings, a missing or mis-shaped tensor.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from hpcml.errors import ConfigError

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def read_config(folder: Path) -> dict[str, Any]:
    path = folder / CONFIG
    if not path.is_file():
        raise ConfigError(
            f"{folder} holds no {CONFIG}; give the folder a Hugging Face GPT-2 model was saved "
            "to (save_pretrained writes config.json and model.safetensors)."
        )
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ConfigError(f"{path} is not valid JSON.") from None
    if not isinstance(cfg, dict) or cfg.get("model_type") != "gpt2":
        found = cfg.get("model_type") if isinstance(cfg, dict) else None
        raise ConfigError(
            f"{path} describes model_type {found!r}; only GPT-2-shaped models ('gpt2') import "
            "into hpcml's gpt."
        )
    checks = [
        (
            cfg.get("activation_function", "gelu_new") in TANH_GELU,
            f"activation_function {cfg.get('activation_function')!r} (hpcml's gpt uses tanh-GELU)",
        ),
        (
            float(cfg.get("layer_norm_epsilon", 1e-5)) == 1e-5,
            f"layer_norm_epsilon {cfg.get('layer_norm_epsilon')} (hpcml's gpt uses 1e-5)",
        ),
        (not cfg.get("scale_attn_by_inverse_layer_idx", False), "scale_attn_by_inverse_layer_idx"),
        (not cfg.get("reorder_and_upcast_attn", False), "reorder_and_upcast_attn"),
        (cfg.get("scale_attn_weights", True), "scale_attn_weights false"),
        (cfg.get("tie_word_embeddings", True), "untied word embeddings"),
        (
            cfg.get("n_inner") in (None, 4 * int(cfg.get("n_embd", 0))),
            f"n_inner {cfg.get('n_inner')} (hpcml's gpt uses 4 x n_embd)",
        ),
    ]
    for ok, what in checks:
        if not ok:
            raise ConfigError(f"{path}: {what} is not supported by hpcml's gpt; it cannot import.")
    return cfg


def gpt_args(cfg: dict[str, Any]) -> dict[str, Any]:
    """The zoo gpt's arguments for a GPT-2 config."""
    try:
        return {
            "vocab_size": int(cfg["vocab_size"]),
            "max_seq_len": int(cfg["n_positions"]),
            "n_layer": int(cfg["n_layer"]),
            "n_head": int(cfg["n_head"]),
            "d_model": int(cfg["n_embd"]),
            "mlp": "gelu",
            "mlp_ratio": 4.0,
            "dropout": 0.0,
            "bias": True,
            "tie_embeddings": True,
        }
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(
            f"the GPT-2 {CONFIG} lacks or mistypes {exc}; it cannot import."
        ) from None


def convert(
    state: dict[str, torch.Tensor], args: dict[str, Any], padded_vocab: int
) -> dict[str, torch.Tensor]:
    """Hugging Face GPT-2 tensor names and layouts -> the zoo gpt's state dict."""
    sd = {k.removeprefix("transformer."): v for k, v in state.items()}
    d, n_layer = args["d_model"], args["n_layer"]

    def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = sd.get(name)
        if t is None:
            raise ConfigError(f"{WEIGHTS} has no tensor {name!r}; it is not a GPT-2 checkpoint.")
        if tuple(t.shape) != shape:
            raise ConfigError(
                f"{WEIGHTS}: {name} has shape {tuple(t.shape)}, the config implies {shape}."
            )
        return t.to(torch.float32)

    vocab = args["vocab_size"]
    tok = take("wte.weight", (vocab, d))
    out: dict[str, torch.Tensor] = {}
    padded = torch.zeros(padded_vocab, d)
    padded[:vocab] = tok
    out["emb.tok.weight"] = padded
    out["lm_head.weight"] = padded  # tied
    out["emb.pos.weight"] = take("wpe.weight", (args["max_seq_len"], d))
    for i in range(n_layer):
        h, b = f"h.{i}.", f"blocks.{i}."
        for hf, ours in (("ln_1", "attn_norm"), ("ln_2", "mlp_norm")):
            out[f"{b}{ours}.weight"] = take(f"{h}{hf}.weight", (d,))
            out[f"{b}{ours}.bias"] = take(f"{h}{hf}.bias", (d,))
        qkv_w = take(f"{h}attn.c_attn.weight", (d, 3 * d))  # Conv1D: (in, out)
        qkv_b = take(f"{h}attn.c_attn.bias", (3 * d,))
        for j, name in enumerate(("wq", "wk", "wv")):
            out[f"{b}attn.{name}.weight"] = qkv_w[:, j * d : (j + 1) * d].t().contiguous()
            out[f"{b}attn.{name}.bias"] = qkv_b[j * d : (j + 1) * d].clone()
        out[f"{b}attn.wo.weight"] = take(f"{h}attn.c_proj.weight", (d, d)).t().contiguous()
        out[f"{b}attn.wo.bias"] = take(f"{h}attn.c_proj.bias", (d,))
        out[f"{b}mlp.w1.weight"] = take(f"{h}mlp.c_fc.weight", (d, 4 * d)).t().contiguous()
        out[f"{b}mlp.w1.bias"] = take(f"{h}mlp.c_fc.bias", (4 * d,))
        out[f"{b}mlp.w2.weight"] = take(f"{h}mlp.c_proj.weight", (4 * d, d)).t().contiguous()
        out[f"{b}mlp.w2.bias"] = take(f"{h}mlp.c_proj.bias", (d,))
    out["norm.weight"] = take("ln_f.weight", (d,))
    out["norm.bias"] = take("ln_f.bias", (d,))
    return out


def import_gpt2(folder: str | Path) -> tuple[Any, dict[str, Any]]:
    """The zoo gpt (eval mode) holding the GPT-2 weights of `folder`, and its arguments."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from hpcml.models.gpt import build_gpt, config_of

    root = Path(folder).expanduser()
    if not root.is_dir():
        raise ConfigError(
            f"{root} is not a folder; give the folder holding {CONFIG} and {WEIGHTS}."
        )
    args = gpt_args(read_config(root))
    weights = root / WEIGHTS
    if not weights.is_file():
        raise ConfigError(
            f"{root} holds no {WEIGHTS}; save the model with safetensors (save_pretrained does "
            "by default). pytorch_model.bin is a pickle and is not read."
        )
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError) as exc:
        raise ConfigError(f"{weights} cannot be read as safetensors ({exc}).") from None
    model = build_gpt(**args)
    converted = convert(state, args, config_of(args).padded_vocab)
    model.load_state_dict(converted, strict=True)
    return model.eval(), args


def import_tokenizer(folder: str | Path, model_vocab: int) -> tuple[bytes, dict[str, Any]] | None:
    """The bytes of `folder`'s tokenizer.json and the record model.json keeps of it (end token:
    config.json's eos_token_id when the tokenizer has it), or None when there is no such file.
    Refused in one sentence: a file that is not byte-level BPE, or a vocabulary larger than the
    model's."""
    from hpcml.models.tokenizer import FILE, read_hf_tokenizer, tokenizer_record

    root = Path(folder).expanduser()
    path = root / FILE
    if not path.is_file():
        return None
    eos = read_config(root).get("eos_token_id")
    tok, data = read_hf_tokenizer(path)
    if isinstance(eos, int) and 0 <= eos < tok.vocab_size:
        tok.end_token = eos
    if tok.vocab_size > model_vocab:
        raise ConfigError(
            f"{path} has {tok.vocab_size} tokens, more than the model's vocab_size of "
            f"{model_vocab} in {CONFIG}; give the tokenizer the model was trained with."
        )
    return data, {**tokenizer_record(tok, data), **chat_config(root)}


def _token_text(value: Any) -> str | None:
    """A special token of tokenizer_config.json: a string, or an AddedToken's dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def chat_config(root: Path) -> dict[str, str]:
    """The chat template (and the bos/eos texts it may use) of `root`'s tokenizer_config.json
    (or chat_template.jinja, where newer transformers save it); {} when there is none. A list of
    named templates gives its "default" one."""
    config_path = root / "tokenizer_config.json"
    config: Any = {}
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(
                f"{config_path} cannot be read as JSON ({exc}); fix or remove it."
            ) from None
    config = config if isinstance(config, dict) else {}
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    jinja = root / "chat_template.jinja"
    if jinja.is_file():
        template = jinja.read_text(encoding="utf-8")
    out = {
        "chat_template": template if isinstance(template, str) else None,
        "bos_text": _token_text(config.get("bos_token")),
        "eos_text": _token_text(config.get("eos_token")),
    }
    return {k: v for k, v in out.items() if v is not None}
