"""A training step's peak memory traced on fake tensors, against the same step measured on real
CPU tensors, with the formula path's prediction beside it.

Traced: `hpcml.models.memtrace.trace_step` (torch's MemTracker over FakeTensorMode: no
allocation). Measured: `hpcml.models.allocations.measure_step_peak_bytes` (the states and
inputs a step starts with, plus the CPU allocator's peak rise reported to torch's profiler).
Formula: `hpcml.plan.memory.per_device_bytes` for the same model, batch, precision and optimizer
(the zoo CNN table at 3x32x32 only: at 3x64x64 it has no activations to give). Bytes are
counted, not timed, so one repetition is exact up to the allocator's order within a
microsecond; two are run and their spread reported.

    PYTHONPATH=src python benchmarks/plan_trace.py [--out benchmarks/results]

Writes plan_trace.json and plan_trace.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

REPEATS = 2


def _loss(out: Any, y: Any) -> Any:
    import torch.nn.functional as F

    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def resnet(side: int, batch: int) -> tuple[dict[str, Any], Any]:
    import torch

    from hpcml.models.zoo import build_model
    from hpcml.plan.memory import Layout, Training, per_device_bytes
    from hpcml.plan.shapes import model_shape

    parts = {
        "build": lambda: build_model("resnet18", {"num_classes": 10}).train(),
        "make_optimizer": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
        "make_batches": lambda: [
            (torch.randn(batch, 3, side, side), torch.zeros(batch, dtype=torch.int64))
        ],
        "loss_fn": _loss,
    }
    shape = model_shape("resnet18")
    if side != 32:  # the table answers for 3x32x32; elsewhere plan check has no activations
        from dataclasses import replace

        shape = replace(shape, activation_bytes_per_sample=None)
    mem = per_device_bytes(shape, Layout(micro_batch=batch), Training("fp32", "adamw"), 1)
    return parts, mem


def llama(batch: int, seq: int) -> tuple[dict[str, Any], Any]:
    import torch
    from torch import nn
    from transformers import LlamaConfig, LlamaForCausalLM

    from hpcml.plan.memory import Layout, Training, per_device_bytes
    from hpcml.plan.shapes import shape_from_raw

    dims = {"hidden": 128, "ffn": 344, "heads": 4, "kv": 2, "vocab": 512, "layers": 1}
    config = LlamaConfig(
        vocab_size=dims["vocab"],
        hidden_size=dims["hidden"],
        intermediate_size=dims["ffn"],
        num_hidden_layers=dims["layers"],
        num_attention_heads=dims["heads"],
        num_key_value_heads=dims["kv"],
        max_position_embeddings=seq,
        attn_implementation="sdpa",
    )

    class Logits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm = LlamaForCausalLM(config)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.lm(input_ids=ids).logits  # type: ignore[no-any-return]

    def build() -> nn.Module:
        # Built in bf16 (a stock bf16 checkpoint's dtype); `.to()` cannot swap fake tensors.
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            return Logits().train()
        finally:
            torch.set_default_dtype(default)

    def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
        ids = torch.zeros(batch, seq, dtype=torch.int64)  # made under the tracer's fake mode
        return [(ids, ids.clone())]

    parts = {
        "build": build,
        "make_optimizer": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3),
        "make_batches": batches,
        "loss_fn": _loss,
    }
    shape = shape_from_raw(
        layers=dims["layers"],
        hidden=dims["hidden"],
        heads=dims["heads"],
        seq=seq,
        vocab=dims["vocab"],
        ffn_hidden=dims["ffn"],
        kv_heads=dims["kv"],
        swiglu=True,
    )
    training = Training("bf16", "adamw", weights="pure")
    mem = per_device_bytes(shape, Layout(micro_batch=batch, attention="sdpa"), training, 1)
    return parts, mem


CASES = {
    "resnet18 3x32x32, batch 4, fp32": lambda: resnet(32, 4),
    "resnet18 3x64x64, batch 4, fp32": lambda: resnet(64, 4),
    "Llama block (HF), bf16, SDPA, GQA 4/2, batch 2 x 256": lambda: llama(2, 256),
}


def run_case(name: str) -> dict[str, Any]:
    from hpcml.models.allocations import measure_step_peak_bytes
    from hpcml.models.memtrace import trace_step

    parts, mem = CASES[name]()
    traced = trace_step(**parts)
    measured = [measure_step_peak_bytes(**parts) for _ in range(REPEATS)]
    med = statistics.median(measured)
    return {
        "case": name,
        "traced_peak_bytes": traced.peak_bytes,
        "measured_peak_bytes": {"median": med, "min": min(measured), "max": max(measured)},
        "traced_over_measured": traced.peak_bytes / med,
        "formula_peak_bytes": mem.total_bytes,
        "formula_over_measured": mem.total_bytes / med,
        "traced_activations_bytes": traced.activation_peak_bytes,
        "formula_activations_bytes": mem.activations_bytes,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = ap.parse_args()
    rows = [run_case(name) for name in CASES]
    result = {
        "question": "Does the traced step (fake tensors, torch's MemTracker) predict the peak "
        "memory the same step takes on real tensors, and how far is the formula path?",
        "command": "PYTHONPATH=src python benchmarks/plan_trace.py",
        "repeats": REPEATS,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "plan_trace.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "| case | traced MB | measured MB (min-max) | traced/measured | formula MB | "
        "formula/measured |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        m = r["measured_peak_bytes"]
        lines.append(
            f"| {r['case']} | {r['traced_peak_bytes'] / 1e6:.2f} | {m['median'] / 1e6:.2f} "
            f"({m['min'] / 1e6:.2f}-{m['max'] / 1e6:.2f}) | {r['traced_over_measured']:.3f} | "
            f"{r['formula_peak_bytes'] / 1e6:.2f} | {r['formula_over_measured']:.3f} |"
        )
    table = "\n".join(lines)
    (args.out / "plan_trace.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
