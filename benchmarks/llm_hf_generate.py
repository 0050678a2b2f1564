"""hpcml's generation engine against Hugging Face `transformers` `generate`, on the same weights.

One randomly initialised GPT-2-shaped model is made with transformers (GPT2LMHeadModel, byte
vocabulary, float32), saved with `save_pretrained` and imported into hpcml's gpt with
`hpcml.models.hf_gpt2` (tests/unit/test_hf_gpt2.py checks the import: equal logits, equal
greedy tokens). A fixed batch of requests (prompt lengths and output lengths drawn from a
seeded generator) is then generated, greedily, all requests known up front (offline
throughput), by:

  hf-generate       transformers' `generate` with its KV cache, in batches of --batch requests
                    (left-padded; each batch runs until its longest request has its tokens)
  hpcml-static      hpcml's engine with static batching (a batch of --batch starts when the
                    previous one has ended)
  hpcml-continuous  hpcml's engine with continuous batching (at most --batch sequences per step;
                    a finished sequence's slot is refilled at the next step)

Output tokens/s counts each request's own max_new_tokens (the tokens a user asked for), over
the wall time of the whole set. Modes rotate within each repetition; the report gives the
median and [min .. max] over --repeats and ratios of medians. It also reports how many
requests' greedy tokens agree between hpcml and transformers (float32: a near-tie can flip a
token; the float64 test is exact).

    python benchmarks/llm_hf_generate.py      # writes benchmarks/results/llm_hf_generate.*
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
MODES = ("hf-generate", "hpcml-static", "hpcml-continuous")


def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(16, 96))
    p.add_argument("--output-len", type=int, nargs=2, default=(16, 96))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--note", default="")
    p.add_argument("--out", type=Path, default=RESULTS)
    return p.parse_args()


def make_models(
    folder: Path, layers: int, d_model: int, seed: int, positions: int = 256
) -> tuple[Any, Any, Any]:
    """A randomly initialised GPT-2 (byte vocabulary, 4 heads, `positions` positions, no dropout)
    made and saved by transformers, the same weights imported into hpcml's gpt, and the
    gpt's arguments."""
    import transformers

    from hpcml.models.hf_gpt2 import import_gpt2

    cfg = transformers.GPT2Config(
        vocab_size=256,
        n_positions=positions,
        n_embd=d_model,
        n_layer=layers,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=None,
    )
    torch.manual_seed(seed)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(folder)
    hf = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    ours, args = import_gpt2(folder)
    return hf, ours, args


def left_pad(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask of a batch, prompts left-padded with 0 to the longest (as
    decoder-only generation needs)."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for j, p in enumerate(prompts):
        ids[j, width - len(p) :] = torch.tensor(p)
        mask[j, width - len(p) :] = 1
    return ids, mask


def workload(a: argparse.Namespace) -> list[tuple[list[int], int]]:
    rng = random.Random(a.seed)
    return [
        (
            [rng.randrange(1, 256) for _ in range(rng.randint(*a.prompt_len))],
            rng.randint(*a.output_len),
        )
        for _ in range(a.requests)
    ]


def run_hf(hf: Any, work: list[tuple[list[int], int]], batch: int) -> list[list[int]]:
    out: list[list[int]] = []
    for i in range(0, len(work), batch):
        chunk = work[i : i + batch]
        ids, mask = left_pad([p for p, _ in chunk])
        width = ids.shape[1]
        longest = max(n for _, n in chunk)
        with torch.no_grad():
            gen = hf.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                use_cache=True,
                pad_token_id=0,
            )
        for j, (_, n) in enumerate(chunk):
            out.append(gen[j, width : width + n].tolist())
    return out


def run_hpcml(
    model: Any, work: list[tuple[list[int], int]], batch: int, static: bool
) -> list[list[int]]:
    from hpcml.serve.generate.engine import Engine, EngineConfig
    from hpcml.serve.generate.sampling import SamplingParams

    blocks = sum(-(-(len(p) + n) // 16) for p, n in work) + 16
    engine = Engine(
        model,
        EngineConfig(
            kv_cache_blocks=blocks,
            block_size=16,
            max_num_seqs=batch,
            max_batched_tokens=max(256, batch * 96),
            static_batching=static,
        ),
    )
    ids = [engine.submit(p, SamplingParams(max_tokens=n, temperature=0.0)) for p, n in work]
    got: dict[int, list[int]] = {i: [] for i in ids}
    while engine.has_work:
        for ev in engine.step():
            if ev.token is not None:
                got[ev.seq_id].append(ev.token)
    return [got[i] for i in ids]


def main() -> None:
    a = arguments()
    torch.set_num_threads(os.cpu_count() or 1)
    work = workload(a)
    tokens = sum(n for _, n in work)
    with tempfile.TemporaryDirectory() as tmp:
        hf, ours, _ = make_models(Path(tmp) / "gpt2", a.layers, a.d_model, a.seed)
    runs: dict[str, list[float]] = {m: [] for m in MODES}
    outputs: dict[str, list[list[int]]] = {}
    for rep in range(a.repeats + 1):  # the first pass warms up and is not counted
        order = MODES[rep % 3 :] + MODES[: rep % 3]
        for mode in order:
            t0 = time.perf_counter()
            if mode == "hf-generate":
                out = run_hf(hf, work, a.batch)
            else:
                out = run_hpcml(ours, work, a.batch, static=mode == "hpcml-static")
            dt = time.perf_counter() - t0
            outputs[mode] = out
            if rep:
                runs[mode].append(tokens / dt)
                print(f"repeat {rep} {mode}: {tokens / dt:,.0f} tokens/s", flush=True)
    agree = sum(
        x == y for x, y in zip(outputs["hf-generate"], outputs["hpcml-continuous"], strict=True)
    )
    med = {m: statistics.median(v) for m, v in runs.items()}
    result = {
        "benchmark": "llm_hf_generate",
        "command": "python benchmarks/llm_hf_generate.py " + " ".join(sys.argv[1:]),
        "note": a.note,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "transformers": _version("transformers"),
        },
        "settings": {
            k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(a).items() if k != "out"
        },
        "output_tokens": tokens,
        "tokens_per_s": runs,
        "median_tokens_per_s": med,
        "ratios_of_medians": {
            "hpcml-continuous / hf-generate": med["hpcml-continuous"] / med["hf-generate"],
            "hpcml-static / hf-generate": med["hpcml-static"] / med["hf-generate"],
            "hpcml-continuous / hpcml-static": med["hpcml-continuous"] / med["hpcml-static"],
        },
        "greedy_requests_equal_to_hf": f"{agree} of {len(work)}",
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "llm_hf_generate.json").write_text(json.dumps(result, indent=1))
    (a.out / "llm_hf_generate.md").write_text(markdown(result))
    print(markdown(result))


def markdown(r: dict[str, Any]) -> str:
    s = r["settings"]
    lines = [
        f"Offline generation, {s['requests']} requests (prompts {s['prompt_len']}, outputs "
        f"{s['output_len']} tokens), batch {s['batch']}, GPT-2 shape {s['layers']} x "
        f"{s['d_model']}, float32, {r['machine']['cpus']} CPU threads; output tokens/s, median "
        f"[min .. max] of {s['repeats']}." + (f" Note: {r['note']}" if r["note"] else ""),
        "",
        "| mode | tokens/s |",
        "|---|---:|",
    ]
    for m, v in r["tokens_per_s"].items():
        lines.append(f"| {m} | {statistics.median(v):,.0f} [{min(v):,.0f} .. {max(v):,.0f}] |")
    lines.append("")
    for k, v in r["ratios_of_medians"].items():
        lines.append(f"{k}: {v:.2f}x  ")
    lines.append(f"greedy outputs equal to transformers: {r['greedy_requests_equal_to_hf']}")
    return "\n".join(lines) + "\n"


def _version(pkg: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(pkg)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
