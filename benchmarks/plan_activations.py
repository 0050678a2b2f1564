"""Saved-activation bytes of the zoo's gpt sizes on CPU, measured and predicted.

For each size the model is built in fp32 and one forward pass with the loss runs under
hpcml.train.memprobe's saved-tensor hooks (storages counted once, parameters apart), with
PyTorch's fused SDPA kernel (what the zoo uses) and with its math kernel (eager attention,
the softmax kept). The planner's prediction (`plan memory`, fp32, micro-batch 1) and the
Korthikanti et al. 2022 closed forms for the same dimensions (Table 2: sbh(34 + 5as/h) per
layer for 16-bit activations with dropout; with FlashAttention or selective recomputation
sbh*34) sit beside them. gpt-1.3b runs at a shorter sequence to keep the host's memory low.

    PYTHONPATH=src python benchmarks/plan_activations.py [--out benchmarks/results]

Writes plan_activations.json and plan_activations.md. Bytes are a count, not a timing: one
repetition is exact (the same shapes give the same bytes on every run).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

CASES = [("gpt-tiny", 64), ("gpt2-small", 1024), ("gpt-350m", 1024), ("gpt-1.3b", 256)]


def measure(name: str, seq: int, eager: bool) -> int:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from hpcml.models.zoo import build_model
    from hpcml.train.losses import cross_entropy
    from hpcml.train.memprobe import SavedActivationProbe

    torch.manual_seed(0)
    model = build_model(name, {"max_seq_len": seq})
    vocab = model.cfg.vocab_size  # type: ignore[union-attr]
    x = torch.randint(0, vocab, (1, seq))
    probe = SavedActivationProbe(model)
    with sdpa_kernel(SDPBackend.MATH if eager else SDPBackend.FLASH_ATTENTION), probe.sample():
        loss = cross_entropy(model(x), x)
    out = int(probe.result(torch.device("cpu"))["saved_activation_bytes"])
    del loss, model, probe
    gc.collect()
    return out


def korthikanti(layers: int, s: int, h: int, a: int, v: int, flash: bool) -> float:
    """16-bit activations with dropout (their setting), per Table 2 and Sec. 4.3, b = 1."""
    per = s * h * (34 + (0 if flash else 5 * a * s / h))
    return layers * per + 4 * s * h * (1 + v / h) + s * h


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    a = ap.parse_args()

    import multiprocessing as mp

    from hpcml.plan.memory import Layout, Training, per_device_bytes
    from hpcml.plan.shapes import model_shape

    rows: list[dict[str, Any]] = []
    # Each measurement in a fresh process: freed weights of a 1.3B model do not always return
    # to the OS, and two of them at once do not fit a small host.
    ctx = mp.get_context("spawn")
    for name, seq in CASES:
        shape = model_shape(name, {"max_seq_len": seq})
        for attention in ("sdpa", "eager"):
            with ctx.Pool(1) as pool:
                measured = pool.apply(measure, (name, seq, attention == "eager"))
            predicted = per_device_bytes(
                shape, Layout(attention=attention), Training("fp32"), 1
            ).activations_bytes
            k16 = korthikanti(
                shape.layers, seq, shape.hidden, shape.heads, shape.vocab, attention != "eager"
            )
            rows.append(
                {
                    "model": name,
                    "seq": seq,
                    "attention": attention,
                    "measured_bytes": measured,
                    "predicted_bytes": predicted,
                    "ratio": predicted / measured,
                    "korthikanti_16bit_dropout_bytes": k16,
                }
            )
            print(rows[-1], flush=True)
            write(a.out, rows)


def write(out: Path, rows: list[dict[str, Any]]) -> None:
    a_out = out
    a_out.mkdir(parents=True, exist_ok=True)
    result = {
        "question": "saved activations of the zoo gpt sizes, fp32, batch 1, CPU",
        "command": "PYTHONPATH=src python benchmarks/plan_activations.py",
        "rows": rows,
    }
    (a_out / "plan_activations.json").write_text(json.dumps(result, indent=1))
    lines = [
        "| model | seq | attention | measured MB | predicted MB | ratio | Korthikanti 16-bit MB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['seq']} | {r['attention']} | "
            f"{r['measured_bytes'] / 1e6:,.1f} | {r['predicted_bytes'] / 1e6:,.1f} | "
            f"{r['ratio']:.3f} | {r['korthikanti_16bit_dropout_bytes'] / 1e6:,.1f} |"
        )
    (a_out / "plan_activations.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
