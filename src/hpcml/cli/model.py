"""`hpcml model list|info|import-hf`: the model zoo, and GPT-2 weights from Hugging Face."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from hpcml.cli.common import console, print_json

app = typer.Typer(
    help="The model zoo: list models and show their size and FLOPs.", no_args_is_help=True
)


@app.command("list")
def list_cmd(
    json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """List the models in the zoo."""
    from hpcml.models.zoo import list_models

    specs = list_models()
    if json_out:
        print_json(
            [
                {"name": s.name, "input_shape": list(s.input_shape), "description": s.description}
                for s in specs
            ]
        )
        return
    table = Table(title="hpcml model zoo")
    table.add_column("name")
    table.add_column("input (per sample)")
    table.add_column("description")
    for s in specs:
        table.add_row(s.name, "x".join(map(str, s.input_shape)), s.description)
    console.print(table)


def model_info(name: str, args: dict[str, Any]) -> dict[str, Any]:
    import torch

    from hpcml.models.zoo import build_model, count_parameters, forward_flops_per_sample, get_spec

    spec = get_spec(name)
    # Zoo models are built on the meta device: shapes and FLOPs without allocating weights,
    # so `model info gpt-1.3b` is instant; user models may need real tensors.
    device = "meta" if ":" not in name else "cpu"
    with torch.device(device):
        model = build_model(name, args)
    shape = spec.shape_for(args)
    info = {
        "name": name,
        "parameters": count_parameters(model),
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "input_shape": list(shape),
        "input_dtype": spec.input_dtype,
        "forward_flops_per_sample": forward_flops_per_sample(
            model, shape, spec.input_dtype, device=device
        ),
        "param_bytes_fp32": sum(p.numel() * 4 for p in model.parameters()),
    }
    # Backward costs about twice the forward (Kaplan et al. 2020, sec. 2.1): training = 3x.
    info["train_flops_per_sample"] = 3 * int(info["forward_flops_per_sample"])  # type: ignore[call-overload]
    if spec.train_flops_per_token_fn is not None:
        info["tokens_per_sample"] = int(shape[0])
        info["train_flops_per_token"] = spec.train_flops_per_token_fn(args)
    return info


@app.command("info")
def info_cmd(
    name: str = typer.Argument(..., help="Zoo name or import path mypkg.models:build."),
    args: str = typer.Option(
        "{}", "--args", help="Builder arguments as JSON, e.g. '{\"num_classes\": 100}'."
    ),
    json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Parameters and forward FLOPs per sample (counted with torch's FlopCounterMode)."""
    from hpcml.errors import ConfigError

    try:
        parsed = json.loads(args)
    except json.JSONDecodeError:
        raise ConfigError(
            f"--args {args!r} is not valid JSON; pass an object like '{{\"num_classes\": 100}}'."
        ) from None
    info = model_info(name, parsed)
    if json_out:
        print_json(info)
        return
    table = Table(title=f"model {name}", show_header=False)
    table.add_column("key")
    table.add_column("value", justify="right")
    table.add_row("parameters", f"{info['parameters']:,}")
    table.add_row("input shape (per sample)", "x".join(map(str, info["input_shape"])))
    table.add_row("forward FLOPs / sample", f"{info['forward_flops_per_sample']:,}")
    table.add_row("training FLOPs / sample (3x fwd)", f"{info['train_flops_per_sample']:,}")
    if "train_flops_per_token" in info:
        table.add_row("training FLOPs / token (6N + 12LHQT)", f"{info['train_flops_per_token']:,}")
    table.add_row("fp32 parameter bytes", f"{info['param_bytes_fp32']:,}")
    console.print(table)


@app.command("import-hf")
def import_hf_cmd(
    folder: Path = typer.Argument(
        ...,
        help="A local Hugging Face GPT-2 folder: config.json and model.safetensors "
        "(and tokenizer.json, copied into the export for text serving).",
    ),
    out: Path = typer.Option(..., "--out", help="Export folder to write (must not exist)."),
) -> None:
    """Import GPT-2-shaped Hugging Face weights as an hpcml export that `hpcml serve` loads."""
    from hpcml.errors import ConfigError
    from hpcml.models.export import save_export
    from hpcml.models.hf_gpt2 import import_gpt2, import_tokenizer
    from hpcml.models.tokenizer import FILE

    if out.exists():
        raise ConfigError(f"--out {out} already exists; give a new folder (nothing was written).")
    model, args = import_gpt2(folder)
    seq, vocab = args["max_seq_len"], args["vocab_size"]
    # Checked before anything is written: a refused tokenizer leaves no half export.
    tokenizer = import_tokenizer(folder, vocab)
    metadata: dict[str, Any] = {"imported_from": str(folder), "format": "huggingface gpt2"}
    if tokenizer is not None:
        metadata["tokenizer"] = tokenizer[1]
    # Registered zoo name of the GPT-2 family; the arguments give every field of its config.
    try:
        save_export(
            out,
            model,
            "gpt2-small",
            args,
            (seq,),
            (seq, vocab),
            input_dtype="int64",
            task="language_modeling",
            metadata=metadata,
        )
        if tokenizer is not None:
            (out / FILE).write_bytes(tokenizer[0])
    except OSError as exc:
        raise ConfigError(
            f"--out {out} cannot be written ({exc.strerror or exc}); give a writable folder."
        ) from None
    with_tok = f", {FILE} copied" if tokenizer is not None else " (no tokenizer.json: token ids)"
    console.print(
        f"wrote {out}: gpt {args['n_layer']} x {args['d_model']}, vocabulary {vocab}{with_tok}"
    )
