"""The benchmarks' questions and their one current answer each: the canonical result files.

Each `Question` names the file of `benchmarks/results/` that answers it (one per question and
device kind; the GPU's live in `results/gpu/` with a README of their own) and how to read its
headline ratio and spread from the JSON. Superseded or exploratory runs live in
`results/archive/` (`ARCHIVE`: kept and linked from the page, never headlined). The benchmarks
page (benchmarks_page.py) and the README's benchmark table are both made from this list, so a
rerun that changes a ratio changes them: `python docs/gen/questions.py --write-readme`
rewrites the README's table, and tests/unit/test_benchmark_questions.py fails while it is stale.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import headlines as h
from headlines import Doc, span


@dataclass(frozen=True)
class Readme:
    """This question's row in the README's benchmark table."""

    command: str  # Markdown
    headline: Callable[[Doc], str]  # Markdown
    page: tuple[str, str]  # (link text, path under docs/)


@dataclass(frozen=True)
class Question:
    stem: str  # the canonical result: benchmarks/results/STEM.json (and STEM.png when plotted)
    title: str  # the question in a few words
    headline: Callable[[Doc], str]  # the headline ratio(s) and what they compare
    spread: Callable[[Doc], str]  # their spread over repetitions (or why there is none)
    readme: Readme | None = None
    sources: tuple[str, ...] = ()  # other files of results/ this one was computed from
    command: str | None = None  # when the result does not record the command that made it


QUESTIONS: tuple[Question, ...] = (
    Question(
        "serving_capacity",
        "serving capacity at p99 ≤ 50 / 100 ms vs LitServe, Ray Serve, plain FastAPI",
        h.serving,
        h.serving_spread,
        Readme(
            "`python benchmarks/serving.py --servers hpcml-batched,hpcml-bs1,litserve,fastapi "
            "--peer-path DIR --tag capacity`",
            h.serving_readme,
            ("serving", "guides/serving.md"),
        ),
        command="python benchmarks/serving.py --servers hpcml-batched,hpcml-bs1,litserve,fastapi "
        "--peer-path DIR --tag capacity",
    ),
    Question(
        "llm_serving",
        "continuous vs static batching vs transformers' `generate`, tokens/s at equal p99 "
        "inter-token latency",
        h.llm,
        h.llm_spread,
        Readme(
            "`python benchmarks/llm_serving.py --rate 40 --max-seqs 8 16 32 64 --itl-objectives "
            "10 15 25 50`",
            h.llm_readme,
            ("LLM serving", "guides/llm-serving.md"),
        ),
    ),
    Question(
        "checkpoint_stall_cpu",
        "checkpoint cost, sync vs async: loop time added, stall, time until durable",
        h.ckpt,
        h.ckpt_spread,
        Readme(
            "`python benchmarks/checkpoint_stall.py --hidden 1024 --steps 40 --every 10`",
            h.ckpt_readme,
            ("fault tolerance", "guides/fault-tolerance.md"),
        ),
    ),
    Question(
        "plan_check",
        "planner vs 29 measured runs, out of sample",
        h.plan,
        h.no_spread("median of 3 repeats per run"),
        Readme(
            "`python benchmarks/plan_check.py --steps 16 --repeats 3`",
            h.plan_readme,
            ("planning", "guides/planning.md"),
        ),
        # The result's own command names the temporary folders it wrote to.
        command="python benchmarks/plan_check.py --steps 16 --repeats 3",
    ),
    Question(
        "strategies_cpu",
        "sharding strategies side by side (gpt-tiny, 2 processes)",
        h.strategies,
        h.repeats("repeats", "repeats, medians"),
        Readme(
            "`python benchmarks/strategies_cpu.py --steps 40 --repeats 2`",
            h.strategies_readme,
            ("training", "guides/training.md"),
        ),
    ),
    Question(
        "engine_overhead_cpu",
        "engine overhead vs a hand-written loop and Lightning Fabric",
        h.engine,
        h.engine_spread,
        Readme(
            "`python benchmarks/engine_overhead.py --max-pairs 16` (rounds until the median "
            "ratios' 95% intervals are within +-1%, at most 16)",
            h.engine_readme,
            ("benchmarks", "benchmarks.md"),
        ),
    ),
    Question("checkpoint_verify", "checkpoint verification at resume", h.verify, h.verify_spread),
    Question(
        "data_pipeline",
        "data loading: throughput and data wait",
        h.loader,
        lambda d: f"{d['args']['reps']} repeats",
    ),
    Question(
        "data_pipeline_shards",
        "shard sets: bytes fetched per epoch and data wait",
        h.shards,
        h.no_spread("one run per store"),
        command="python benchmarks/data_pipeline.py --only shards",
    ),
    Question(
        "device_augment",
        "augmentation on the device vs in loader workers",
        h.augment,
        h.repeats("reps"),
    ),
    Question(
        "drift_cost", "drift monitoring cost per request and per check", h.drift, h.drift_spread
    ),
    Question(
        "finetune",
        "LoRA vs full fine-tuning at equal steps",
        h.finetune,
        h.no_spread("one run each"),
    ),
    Question(
        "finetune_gpt2_small",
        "LoRA vs full fine-tuning, gpt2-small",
        h.goals,
        h.no_spread("one run each"),
    ),
    Question(
        "finetune_small",
        "LoRA on int8 and nf4 bases vs fp32",
        h.quant_bases,
        h.no_spread("one run each"),
    ),
    Question(
        "llm_admission",
        "KV-cache admission: positions over the ideal",
        h.admission,
        h.no_spread("one run per setting"),
    ),
    Question(
        "llm_attention",
        "bucketed attention with one long context",
        h.attention,
        h.no_spread("median step time"),
    ),
    Question(
        "llm_kv_gather",
        "KV cache attended in place vs gathered into padded copies",
        h.kv_gather,
        h.kv_gather_spread,
    ),
    Question(
        "llm_hf_generate",
        "LLM engine vs transformers' generate, one process",
        h.hf_generate,
        h.no_spread("ratios of medians"),
    ),
    Question(
        "llm_serving_http_cpu",
        "LLM serving over HTTP, continuous vs static batching",
        h.http,
        h.http_spread,
    ),
    Question(
        "llm_serving_http_gpt2_small",
        "LLM serving over HTTP at GPT-2 small (124M, bf16), continuous vs static batching, "
        "tokens/s at equal p99 inter-token latency",
        h.http,
        h.http_spread,
        Readme(
            "`python benchmarks/llm_serving_http.py --n-layer 12 --d-model 768 --dtype bf16 "
            "--threads 2 --rates ... --repeats 2 --itl-objectives 100 200 400` (two rate "
            "ranges joined with `--merge`; the result has both commands)",
            h.http_readme,
            ("LLM serving", "guides/llm-serving.md"),
        ),
    ),
    Question(
        "llm_step_profile_gpt2_small",
        "LLM engine steps at GPT-2 small, saturated: work of static vs continuous batching",
        h.step_profile,
        h.no_spread("see the raw numbers"),
    ),
    Question(
        "llm_quantize",
        "int8 weight-only quantized decoding",
        h.quantize,
        h.no_spread("medians of repeats"),
    ),
    Question("metrics_overhead", "training-metrics exporter overhead", h.metrics, h.metrics_spread),
    Question(
        "plan_activations",
        "planner's saved-activation bytes vs measured",
        h.activations,
        h.no_spread("deterministic"),
    ),
    Question(
        "plan_trace",
        "planner's traced step (fake tensors) vs the allocator's measured peak",
        h.plan_trace,
        h.no_spread("byte counts; the repeats were identical"),
    ),
    Question(
        "profile_demo",
        "what `hpcml profile` finds: step time per variant",
        h.profile,
        h.no_spread("median of repeats"),
    ),
    Question("serving_budget", "serving CPU budget per request", h.budget, h.repeats("repeats")),
    Question(
        "serving_cpu",
        "serving event-loop CPU per request, before vs after",
        h.serving_cpu,
        h.repeats("repeats"),
    ),
    Question("tracking_overhead", "MLflow tracking overhead", h.tracking, h.repeats("repeats")),
    Question(
        "tune",
        "tuning: ASHA + TPE vs random search",
        h.tune,
        lambda d: (
            "best val accuracy per arm "
            + ", ".join(
                f"{arm} {span(v['best_val_accuracy'], 3, '')}" for arm, v in d["summary"].items()
            )
        ),
    ),
    Question(
        "tune_startup",
        "tuning: trial start-up, warm vs cold",
        h.tune_startup,
        h.no_spread("see the raw numbers"),
    ),
)

ARCHIVE: dict[str, str] = {
    # archived stem -> the stem of the question it was an earlier or exploratory run of
    "serving": "serving_capacity",
    "serving_checked": "serving_capacity",
    "serving_contended": "serving_capacity",
    "serving_h11_quick": "serving_capacity",
    "serving_h11_quick_checked": "serving_capacity",
    "serving_json_batching_contended": "serving_capacity",
    "serving_shared_2core": "serving_capacity",
    "serving_shared_2core_checked": "serving_capacity",
    "serving_uvloop_quick": "serving_capacity",
    "serving_uvloop_quick_checked": "serving_capacity",
    "serving_xeon": "serving_capacity",
    "serving_xeon_checked": "serving_capacity",
    "plan_check_model_bf0e878": "plan_check",
    "plan_check_two_terms": "plan_check",
    "plan_check_measured_2026-11-26": "plan_check",
    "plan_check_replayed_2026-11-27": "plan_check",
    "llm_serving_http_final": "llm_serving_http_cpu",
    "llm_serving_http_long_tailed": "llm_serving_http_cpu",
    "llm_serving_http_rate4": "llm_serving_http_cpu",
    "llm_serving_http_small": "llm_serving_http_cpu",
    "llm_serving_http_both": "llm_serving_http_cpu",
    "llm_serving_http_gpt2_small_hf": "llm_serving_http_gpt2_small",
    "llm_kv_gather_loaded": "llm_kv_gather",
    "tune_step_budget": "tune",
    "tune_shared_startup": "tune",
    "tune_seeds_3_5": "tune",
    "tune_budget24": "tune",
    "tune_steps60": "tune",
    "tune_replay": "tune",
    "tune_replay_steps180": "tune",
    "tune_replay_wide": "tune",
    "llm_step_profile": "llm_step_profile_gpt2_small",
    "llm_step_profile_gpt2_small_loaded": "llm_step_profile_gpt2_small",
}


# --- machine and date, read from whatever the result recorded -------------------------------


def _get(d: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(d, dict) or part not in d:
            return None
        d = d[part]
    return d


def machine(d: Doc) -> str:
    cpus = next(
        (
            v
            for k in (
                "machine.cpus",
                "machine.cpu_count",
                "environment.cpu_count",
                "cpus",
                "cpu_threads",
                "setup.cpus",
            )
            if (v := _get(d, k)) is not None
        ),
        None,
    )
    loads: list[float] = []
    for k in (
        "load_1m.min",
        "load_1m.max",
        "machine.loadavg_before.0",
        "load_average_1m.start",
        "load_average_1m.end",
        "load_avg_1m_at_start",
        "load_average_1m",
    ):
        v = _get(d, k) if not k.endswith(".0") else (_get(d, k[:-2]) or [None])[0]
        if isinstance(v, int | float):
            loads.append(float(v))
    after = _get(d, "machine.loadavg_after")
    if isinstance(after, list) and after:
        loads.append(float(after[0]))
    parts = [f"{cpus} CPU cores"] if cpus else []
    if loads:
        lo, hi = min(loads), max(loads)
        parts.append(
            f"load {lo:.1f}" if round(lo, 1) == round(hi, 1) else f"load {lo:.1f}–{hi:.1f}"
        )
    return ", ".join(parts) or "not recorded"


def date(d: Doc, path: Path) -> str:
    for k in ("date", "environment.time", "machine.date"):
        v = _get(d, k)
        if isinstance(v, str) and re.match(r"\d{4}-\d\d-\d\d", v):
            return v[:10]
    finished = d.get("runs_finished")
    if isinstance(finished, list) and finished:
        return str(finished[-1])[:10]
    title = str(d.get("title", ""))
    m = re.search(r"\b(\d{4}-\d\d-\d\d)\b", title)
    if m:
        return m.group(1)
    try:  # the day the file was committed
        out = subprocess.run(
            ["git", "log", "-1", "--format=%cs", "--", path.name],
            cwd=path.parent,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout.strip()
    except OSError:
        out = ""
    return f"{out} (committed)" if out else "not recorded"


def command(d: Doc, q: Question) -> str:
    cmd = q.command or d.get("command")
    if isinstance(cmd, str) and cmd.strip():
        return " ".join(cmd.split())
    return f"python benchmarks/{q.stem}.py"


# --- the README's table -----------------------------------------------------------------------

README_HEADER = "| question | command | headline | page |"


def load(results: Path, stem: str) -> Doc:
    return json.loads((results / f"{stem}.json").read_text(encoding="utf-8"))


def readme_table(results: Path) -> list[str]:
    """The README's benchmark table, line by line, from the canonical result files."""
    lines = [README_HEADER, "|---|---|---|---|"]
    for q in QUESTIONS:
        if q.readme is None:
            continue
        text, page = q.readme.page
        head = q.readme.headline(load(results, q.stem))
        lines.append(f"| {q.title} | {q.readme.command} | {head} | [{text}](docs/{page}) |")
    return lines


def readme_table_span(readme: str) -> tuple[int, int]:
    """(first, end) line indexes of the benchmark table in the README's text."""
    lines = readme.splitlines()
    first = lines.index(README_HEADER)
    end = first
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return first, end


def write_readme(readme_path: Path, results: Path) -> bool:
    """Rewrite the README's benchmark table from the results; True when it changed."""
    text = readme_path.read_text(encoding="utf-8")
    lines = text.splitlines()
    first, end = readme_table_span(text)
    new = [*lines[:first], *readme_table(results), *lines[end:]]
    out = "\n".join(new) + ("\n" if text.endswith("\n") else "")
    if out != text:
        readme_path.write_text(out, encoding="utf-8")
    return out != text


if __name__ == "__main__":
    root = Path(__file__).resolve().parents[2]
    if sys.argv[1:] != ["--write-readme"]:
        sys.exit("usage: python docs/gen/questions.py --write-readme")
    changed = write_readme(root / "README.md", root / "benchmarks" / "results")
    print("README.md: benchmark table " + ("rewritten" if changed else "already current"))
