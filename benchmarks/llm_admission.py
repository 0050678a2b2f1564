"""Admission under a tight KV cache: positions computed over the ideal, and preemptions.

The issue's case: 16 requests of 90-110 prompt and 130-150 output tokens (seeded), all
submitted at once, blocks of 16, a cache of 64 or 128 blocks (4 or 8 of the requests fit at
their longest). For each `kv_overcommit` it runs the engine to the end on a tiny gpt (the
positions do not depend on the model: every request runs to its max_tokens) and reports the
positions the model computed over the ideal (every prompt and output position once), the
preemptions, the most preemptions of one sequence, and the steps. Before admission took whole
prefills and projected lengths into account, this case computed 3.12x (64 blocks) and 2.45x
(128 blocks) the ideal positions, one sequence preempted 25 times.

    python benchmarks/llm_admission.py     # writes benchmarks/results/llm_admission.{json,md}
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch

from hpcml.models.gpt import GPT, GPTConfig
from hpcml.serve.generate.engine import Engine, EngineConfig
from hpcml.serve.generate.sampling import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results"
OVERCOMMITS = (1.0, 1.25, 1.5, 2.0, 4.0)


def run(blocks: int, overcommit: float, model: GPT) -> dict[str, float]:
    rng = random.Random(0)
    requests = [
        ([rng.randrange(256) for _ in range(rng.randint(90, 110))], rng.randint(130, 150))
        for _ in range(16)
    ]
    config = EngineConfig(kv_cache_blocks=blocks, block_size=16, kv_overcommit=overcommit)
    engine = Engine(model, config)
    seqs = []
    for prompt, max_tokens in requests:
        engine.submit(prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
        seqs.append(engine.waiting[-1])
    steps = 0
    while engine.has_work:
        engine.step()
        steps += 1
    ideal = sum(len(p) + m - 1 for p, m in requests)
    return {
        "kv_cache_blocks": blocks,
        "kv_overcommit": overcommit,
        "positions_over_ideal": round(engine.rows_computed / ideal, 3),
        "preemptions": engine.preemptions,
        "most_preemptions_of_one": max(s.preemptions for s in seqs),
        "steps": steps,
    }


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, max_seq_len=256, n_layer=1, n_head=2, d_model=16))
    rows = [run(b, oc, model.eval()) for b in (64, 128) for oc in OVERCOMMITS]
    RESULTS.mkdir(exist_ok=True)
    out = {
        "question": "Under a tight KV cache, how many positions does the engine compute over the "
        "ideal, and how often is one sequence preempted, for each kv_overcommit?",
        "command": "python benchmarks/llm_admission.py",
        "date": time.strftime("%Y-%m-%d"),
        "rows": rows,
    }
    (RESULTS / "llm_admission.json").write_text(json.dumps(out, indent=2) + "\n")
    lines = [
        "| blocks | kv_overcommit | positions / ideal | preemptions | most of one | steps |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['kv_cache_blocks']} | {r['kv_overcommit']} | {r['positions_over_ideal']} "
        f"| {r['preemptions']} | {r['most_preemptions_of_one']} | {r['steps']} |"
        for r in rows
    ]
    text = (
        "\n".join(lines)
        + f"\n\nDefaults otherwise (watermark 1 block, max_preemptions 2); {out['date']}.\n"
    )
    (RESULTS / "llm_admission.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
