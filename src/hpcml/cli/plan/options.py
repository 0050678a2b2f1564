"""What every `hpcml plan` verb shares: the typer apps, the options that describe a model,
a cluster, a layout and a training setup (grouped for the verbs in hpcml.cli.plan.shared,
which turns their values into plan objects), and output helpers."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import typer

from hpcml.plan.common import GB, PlanError

app = typer.Typer(
    help="Predict memory, communication, step time, the best layout and the cost of training.",
    no_args_is_help=True,
)
cost_app = typer.Typer(
    help="What training costs: a run per hardware option, cloud vs owned, spot vs on-demand.",
    no_args_is_help=True,
)
app.add_typer(cost_app, name="cost")

# --- shared options --------------------------------------------------------------------------

JSON_OPT = typer.Option(False, "--json", help="Machine-readable output.")
CATALOG_OPT = typer.Option(
    None, "--catalog", help="Extra hardware YAML (same layout as the shipped catalog)."
)
MODEL_OPT = typer.Option(None, "--model", "-m", help="Known model (`hpcml plan models`).")
ARGS_OPT = typer.Option("{}", "--args", help="Model builder arguments as JSON (zoo mlp).")
PARAMS_OPT = typer.Option(None, "--params", help="Parameter count, e.g. 7e9.")
LAYERS_OPT = typer.Option(None, "--layers", help="Transformer blocks.")
HIDDEN_OPT = typer.Option(None, "--hidden", help="Hidden size.")
HEADS_OPT = typer.Option(None, "--heads", help="Attention heads.")
SEQ_OPT = typer.Option(None, "--seq", help="Sequence length (tokens per sample).")
VOCAB_OPT = typer.Option(None, "--vocab", help="Vocabulary size.")
FFN_OPT = typer.Option(None, "--ffn-hidden", help="MLP inner size (default 4 x hidden).")
KV_HEADS_OPT = typer.Option(
    None, "--kv-heads", help="Key/value heads (grouped-query attention; default: --heads)."
)
SWIGLU_OPT = typer.Option(
    False, "--swiglu", help="Llama-style blocks: SwiGLU MLP, no biases, untied embeddings."
)
LARGEST_LAYER_OPT = typer.Option(
    None,
    "--largest-layer",
    help="Parameters of the biggest layer (ZeRO-3 with --params alone needs it), e.g. 2e8.",
)
FLOPS_OPT = typer.Option(
    None, "--flops-per-sample", help="Forward FLOPs per sample for a non-transformer."
)
DEVICES_OPT = typer.Option(1, "--devices", "-n", help="Number of accelerators.")
GPU_OPT = typer.Option(None, "--gpu", help="Accelerator (`hpcml plan hardware`), e.g. h100-sxm.")
NODE_OPT = typer.Option(None, "--node", help="Node shape, e.g. hgx-h100 (sets GPU and links).")
PER_NODE_OPT = typer.Option(None, "--gpus-per-node", help="Devices per node.")
INTRA_OPT = typer.Option(None, "--intra", help="Intra-node link, e.g. nvlink4.")
INTER_OPT = typer.Option(None, "--inter", help="Inter-node link, e.g. ib-ndr.")
NICS_OPT = typer.Option(None, "--nics-per-node", help="Network adapters per node.")
TP_OPT = typer.Option(1, "--tp", help="Tensor-parallel degree.")
PP_OPT = typer.Option(1, "--pp", help="Pipeline-parallel degree.")
ZERO_OPT = typer.Option(0, "--zero", help="ZeRO stage 0-3 (3 = FSDP full sharding).")
SP_OPT = typer.Option(None, "--sp/--no-sp", help="Sequence parallelism (default: on when tp>1).")
SCHEDULE_OPT = typer.Option("1f1b", "--schedule", help="Pipeline schedule: 1f1b or interleaved.")
VIRTUAL_OPT = typer.Option(2, "--virtual-stages", help="Chunks per stage (interleaved only).")
MB_OPT = typer.Option(1, "--micro-batch", help="Samples per micro-batch per replica.")
ACCUM_OPT = typer.Option(1, "--grad-accum", help="Micro-batches per step (pipeline's m).")
RECOMPUTE_OPT = typer.Option(
    "none",
    "--recompute",
    help="none, full, op (torchtitan's selective op), layer:K (every K-th block) or "
    "attention-scores (Korthikanti's; eager attention only); hpcml train's names.",
)
ACCUM_REDUCE_OPT = typer.Option(
    "step",
    "--accum-reduce",
    help="ZeRO-2/3 with --grad-accum > 1: step (unsharded gradients held through the "
    "accumulation, hpcml's default) or micro_batch (reduce-scatter every micro-batch); "
    "hpcml's parallel.accum_reduce.",
)
OFFLOAD_OPT = typer.Option(
    "none",
    "--offload",
    help="none, optimizer (optimizer states + gradient shard) or params (+ parameter shards).",
)
ATTENTION_OPT = typer.Option(
    None,
    "--attention",
    help="eager (keeps s x s scores), sdpa or flash (fused); default: the model's own.",
)
GRAD_DTYPE_OPT = typer.Option(
    None,
    "--grad-dtype",
    help="Gradient/reduce type: fp32 (FSDP2 reduce_dtype=float32, Megatron) or bf16; "
    "default: the weights' type.",
)
RESERVE_OPT = typer.Option(
    1.0, "--reserve-gb", help="CUDA context and workspaces kept off each device, in GB."
)
USABLE_OPT = typer.Option(
    0.9, "--usable", help="Share of device memory the allocator can use (fragmentation)."
)
OPTIM_OPT = typer.Option("adamw", "--optimizer", help="adamw, sgd, sgd-nomomentum, adam8bit.")
PRECISION_OPT = typer.Option("bf16", "--precision", help="fp32, tf32, bf16, fp16, fp8.")
WEIGHTS_OPT = typer.Option(
    None,
    "--weights",
    help="mixed (half weights + fp32 master), amp (fp32 weights, autocast) or pure.",
)
EFF_OPT = typer.Option(None, "--efficiency", help="Share of peak FLOP/s reached (calibrated).")
OVERHEAD_OPT = typer.Option(0.0, "--overhead-s", help="Fixed seconds per step (calibrated).")
OVERLAP_OPT = typer.Option(1.0, "--overlap", help="Share of the overlap window comm hides in.")
CALIBRATION_FILE_OPT = typer.Option(
    None,
    "--calibration",
    help="A calibration `hpcml plan check --save-calibration` fitted (JSON): its costs, and "
    "its errors measured out of sample for a 90% interval on step times.",
)


def _catalog(paths: list[Path] | None) -> Any:
    from hpcml.plan.hardware import load_catalog

    return load_catalog(paths or [])


_SIZE_RE = re.compile(r"^\s*([0-9.eE+-]+)\s*([kKmMgGtT]?i?[bB]?)\s*$")
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "m": 1e6,
    "mb": 1e6,
    "g": 1e9,
    "gb": 1e9,
    "t": 1e12,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(text: str) -> float:
    """'1GB' -> 1e9, '256MiB' -> 268435456, '4096' -> 4096."""
    m = _SIZE_RE.match(text)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        raise PlanError(f"size '{text}' is not understood; write e.g. 4096, 256MB, 1GiB.")
    try:
        return float(m.group(1)) * _UNITS[unit]
    except ValueError:
        raise PlanError(f"size '{text}' is not understood; write e.g. 4096, 256MB, 1GiB.") from None


def _short(x: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= size:
            return f"{x / size:.3g}{unit}"
    return f"{x:.3g}"


def _gb(x: float | None) -> str:
    return "-" if x is None else f"{x / GB:,.2f}"


def _finish_plot(fig: Any, ax: Any, title: str, path: Path) -> None:
    """Title, legend and a PNG at `path`; shared by the scaling and TCO plots."""
    import matplotlib.pyplot as plt

    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- advise ----------------------------------------------------------------------------------
