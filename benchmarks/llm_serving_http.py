"""Continuous vs static batching through HTTP: `hpcml serve` with a GPT-2-small-sized model,
a request-rate sweep per workload (throughput vs p99 inter-token latency curves, a PNG), a
uniform and a long-tailed (ShareGPT-like, lognormal) workload, and each workload's
positions-ratio bound beside the measured ratio.

Model: a randomly initialised `transformers` GPT2LMHeadModel (12 layers, d_model 768, 12 heads,
vocabulary 50,257, 1,024 positions by default: GPT-2 small's 124M parameters), saved with a
byte-level BPE tokenizer.json of the same vocabulary and no merges (so a prompt of N printable
characters is N tokens, and no end-of-text token ends a request early), imported with `hpcml
model import-hf` and served by `hpcml serve` (its engine in a process of its own; float32, or
bf16 with `--dtype bf16`, the default where `torch.backends.cpu.get_cpu_capability()` reports
AMX). Random weights do not change the work: every request runs to its max_tokens.

Load: `hpcml.serve.llm_loadtest` (the `hpcml loadtest --llm` client): Poisson arrivals at each
rate of `--rates` for `--duration` s, streamed completions, tokens counted from the server's
streamed `usage`. Workloads (token lengths):

  uniform      prompts uniform 16..128, outputs uniform 8..128
  long-tailed  prompts lognormal(median 32, sigma 0.8, max 512), outputs lognormal(median
               48, sigma 1.0, max 384): heavy right tails like ShareGPT's conversations

Modes: two servers, up at once, with the same settings but `generation.static_batching` (a
batch starts only when the previous has ended; finished sequences pad it until its longest
ends); continuous batching with `generation.max_prefill_tokens` `--chunk` (prompt tokens in a
step that also decodes; 0, the default: none, as the server's default). Each rate runs on one then the other, back to back
(a shared machine's load drifts less between them; which goes first alternates between
repetitions), for `--repeats` sweeps; every point records the 1-minute load average. At equal
p99 inter-token latency (each objective of `--itl-objectives`): in each sweep, each mode's best
throughput among the rates whose p99 ITL meets it, and their ratio; the report gives the
median and [min .. max] over the sweeps. The positions bound: where a step costs in proportion
to the token positions it computes, continuous/static throughput cannot exceed static's
positions over continuous's; computed for each workload from 4,096 of its draws in saturated
batches of `--max-seqs` (static: every sequence of a batch decodes until the batch's longest
output; continuous: each prompt and output position once). The FLOPs ratio weighs each position
by its FLOPs instead: 24 d^2 per layer, plus 2 d V for a row whose logits are read, which
static batching's padding rows skip (so with GPT-2's vocabulary on a small model, where the
head is most of a decode's work, static wastes far less than its positions say). Neither is a
hard bound: a fixed cost per step (Python, small kernels) moves the measured ratio from the
FLOPs ratio toward the ratio of steps, which is above the positions bound.

    python benchmarks/llm_serving_http.py                 # results/llm_serving_http.{json,md,png}
    python benchmarks/llm_serving_http.py --n-layer 2 --d-model 128 --rates 2 8 --duration 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hpcml.models.tokenizer import _byte_level_alphabet
from hpcml.serve.llm_loadtest import Lengths, llm_loadtest

ROOT = Path(__file__).resolve().parents[1]
MODES = ("continuous", "static")
HF = "hf-generate"
RESULTS = ROOT / "benchmarks" / "results"
WORKLOADS = {
    "uniform": (Lengths("uniform", 16, 128), Lengths("uniform", 8, 128)),
    "long-tailed": (Lengths("lognormal", 32, 512, 0.8), Lengths("lognormal", 48, 384, 1.0)),
}


def tokenizer_json(vocab: int) -> str:
    """A byte-level BPE of `vocab` tokens: the 256 bytes, then two-byte tokens, no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    chars = sorted(_byte_level_alphabet().items(), key=lambda cb: cb[1])
    alphabet = [c for c, _ in chars]
    table = {c: i for i, c in enumerate(alphabet)}
    for i in range(vocab - 256):
        table[alphabet[i // 256] + alphabet[i % 256]] = 256 + i
    tok = Tokenizer(models.BPE(vocab=table, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()


def make_export(work: Path, a: argparse.Namespace) -> tuple[Path, int]:
    import transformers

    cfg = transformers.GPT2Config(
        vocab_size=a.vocab,
        n_positions=a.positions,
        n_embd=a.d_model,
        n_layer=a.n_layer,
        n_head=max(1, a.d_model // 64),
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=None,
    )
    torch.manual_seed(a.seed)
    model = transformers.GPT2LMHeadModel(cfg)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(work / "hf")
    (work / "hf" / "tokenizer.json").write_text(tokenizer_json(a.vocab))
    cmd = [sys.executable, "-m", "hpcml", "model", "import-hf", str(work / "hf")]
    subprocess.run([*cmd, "--out", str(work / "export")], check=True, env=_env())
    return work / "export", params


def hf_model(work: Path, a: argparse.Namespace) -> Any:
    import transformers

    torch.set_num_threads(a.threads)
    model = transformers.GPT2LMHeadModel.from_pretrained(work / "hf").eval()
    return model.to(torch.bfloat16) if a.dtype == "bf16" else model


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve(export: Path, work: Path, a: argparse.Namespace, static: bool) -> tuple[Any, str]:
    longest = a.positions
    generation = {
        "kv_cache_blocks": a.max_seqs * -(-longest // 16),  # a full static batch fits
        "block_size": 16,
        "max_num_seqs": a.max_seqs,
        "max_batched_tokens": a.max_seqs * 512 if static else 256,
        "max_prefill_tokens": None if a.chunk == 0 else a.chunk,
        "prefix_sharing": False,
        "static_batching": static,
        "quantize": "bf16" if a.dtype == "bf16" else "none",
        "step_timeout_s": 600,
    }
    config = work / f"serve-{'static' if static else 'continuous'}.json"
    config.write_text(json.dumps({"defaults": {"threads": a.threads}, "generation": generation}))
    port = _free_port()
    cmd = [sys.executable, "-m", "hpcml", "serve", str(export), "--name", "gpt2", "--port",
           str(port), "--config", str(config)]
    log = (work / f"{config.stem}.log").open("w")
    server = subprocess.Popen(cmd, env=_env(), stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    import httpx

    for _ in range(1200):
        if server.poll() is not None:
            raise SystemExit(f"hpcml serve exited: see {log.name}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return server, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.kill()
    raise SystemExit("hpcml serve did not start in 10 minutes")


def positions_bound(prompt: Lengths, output: Lengths, batch: int, seed: int) -> float:
    """Static / continuous token positions over 4,096 draws in saturated batches of `batch`."""
    rng = np.random.default_rng(seed)
    p = np.array(prompt.draw(4096, rng))
    o = np.array(output.draw(4096, rng))
    continuous = int((p + o - 1).sum())
    static = int(p.sum())
    for i in range(0, len(o), batch):
        chunk = o[i : i + batch]
        static += len(chunk) * (int(chunk.max()) - 1)
    return static / continuous


def flops_ratio(prompt: Lengths, output: Lengths, batch: int, seed: int, shape: tuple[int, int, int]) -> float:
    """Static / continuous FLOPs over the draws of `positions_bound`, for a model of `shape`
    (layers, d_model, vocabulary): a position costs 24 d^2 per layer, and a row whose logits are
    read (a prompt's last, every output token) another 2 d V; static batching's padding rows
    read none, so where the head is a large share of a position (a big vocabulary on a small
    model) static wastes less than its positions say."""
    n_layer, d, vocab = shape
    rng = np.random.default_rng(seed)
    p = np.array(prompt.draw(4096, rng))
    o = np.array(output.draw(4096, rng))
    layer, head = 24 * d * d * n_layer, 2 * d * vocab
    continuous = int((p + o - 1).sum()) * layer + int(o.sum()) * head
    static = int(p.sum()) * layer + int(o.sum()) * head
    for i in range(0, len(o), batch):
        chunk = o[i : i + batch]
        static += len(chunk) * (int(chunk.max()) - 1) * layer
    return static / continuous


def point(url: str, a: argparse.Namespace, name: str, rate: float) -> dict[str, Any]:
    prompt, output = WORKLOADS[name]
    r = llm_loadtest(
        base_url=url, model="gpt2", rate=rate, duration_s=a.duration, prompt_len=prompt,
        output_len=output, timeout_s=a.timeout, seed=a.seed, ttft_slo_ms=1e9, itl_slo_ms=1e9,
    ).to_json()
    keys = ("rate", "sent", "ok", "errors", "output_tokens", "output_tokens_per_s", "ttft_ms",
            "itl_ms", "latency_ms")
    r["load_average"] = os.getloadavg()[0]
    print(f"{name:12s} {url[-5:]} rate {rate:6.2f}/s  {r['output_tokens_per_s']:8.1f} tok/s  "
          f"ITL p99 {r['itl_ms'].get('p99', float('nan')):8.1f} ms  ok {r['ok']}/{r['sent']}  "
          f"load {r['load_average']:.1f}",
          flush=True)
    return {k: r[k] for k in (*keys, "load_average")}


def hf_point(hf: Any, a: argparse.Namespace, name: str, rate: float) -> dict[str, Any]:
    """transformers' `generate` on the same weights, in-process (no HTTP): the point's exact
    arrivals, prompt lengths and max_tokens (the draws `llm_loadtest` makes from the same
    seed), in static batches of --max-seqs (`llm_serving.replay_hf`: left-padded prompts, each
    batch run until its longest request has its tokens, its KV cache)."""
    from llm_serving import replay_hf

    prompt, output = WORKLOADS[name]
    rng = np.random.default_rng(a.seed)
    arrivals: list[float] = []
    t = float(rng.exponential(1.0 / rate))
    while t < a.duration:
        arrivals.append(t)
        t += float(rng.exponential(1.0 / rate))
    lengths = prompt.draw(len(arrivals), np.random.default_rng(a.seed + 1))
    outputs = output.draw(len(arrivals), np.random.default_rng(a.seed + 2))
    ids = np.random.default_rng(a.seed + 3)
    requests = [(at, [int(x) for x in ids.integers(256, a.vocab, size=k)], m)
                for at, k, m in zip(arrivals, lengths, outputs, strict=True)]
    m = replay_hf(hf, a.max_seqs, requests)
    r = {"rate": rate, "sent": len(requests), "ok": len(requests), "errors": 0,
         "output_tokens": sum(o for *_, o in requests),
         "output_tokens_per_s": m["output_tokens_per_s"],
         "itl_ms": {"p50": m["itl_p50_ms"], "p99": m["itl_p99_ms"]},
         "ttft_ms": {"p50": m["ttft_p50_ms"], "p99": m["ttft_p99_ms"]},
         "load_average": os.getloadavg()[0]}
    print(f"{name:12s} hf-gen rate {rate:6.2f}/s  {r['output_tokens_per_s']:8.1f} tok/s  "
          f"ITL p99 {m['itl_p99_ms']:8.1f} ms  load {r['load_average']:.1f}", flush=True)
    return r


def saturated(p: dict[str, Any], a: argparse.Namespace) -> bool:
    """Past saturation (errors, or p99 ITL 4x the largest objective): the queue only grows."""
    return bool(p["errors"]) or p["itl_ms"].get("p99", 0) > 4 * max(a.itl_objectives)


def equal_itl(curves: dict[str, list[dict[str, Any]]], objective: float) -> dict[str, Any]:
    best = {}
    for mode, points in curves.items():
        ok = [p["output_tokens_per_s"] for p in points
              if not p["errors"] and p["itl_ms"] and p["itl_ms"]["p99"] <= objective]
        best[mode] = max(ok, default=None)
    c, s, h = best.get("continuous"), best.get("static"), best.get(HF)
    return {"objective_ms": objective, **best, "ratio": c / s if c and s else None,
            "ratio_hf": c / h if c and h else None}


def spread(values: list[float | None]) -> dict[str, float] | None:
    """Median, min and max of the repetitions that have a value (None if one lacks it)."""
    if not values or any(v is None for v in values):
        return None
    got = [float(v) for v in values if v is not None]
    return {"median": statistics.median(got), "min": min(got), "max": max(got)}


def equal_itl_repeated(reps: list[dict[str, list[dict[str, Any]]]], objective: float) -> dict[str, Any]:
    """`equal_itl` in each repetition (each its own sweep), then medians and ranges."""
    rows = [equal_itl(curves, objective) for curves in reps]
    return {"objective_ms": objective, "repetitions": rows,
            **{k: spread([r.get(k) for r in rows])
               for k in ("continuous", "static", HF, "ratio", "ratio_hf")}}


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["workloads"])
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4.5), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        for i, curves in enumerate(result["workloads"][name]["curves"]):
            for mode, color in zip((*MODES, HF), ("C0", "C1", "C2"), strict=True):
                pts = [p for p in curves.get(mode, []) if p["itl_ms"]]
                ax.plot([p["output_tokens_per_s"] for p in pts],
                        [p["itl_ms"]["p99"] for p in pts], marker="o", color=color,
                        alpha=0.8, label=mode if i == 0 else None)
                for p in pts:
                    ax.annotate(f"{p['rate']:g}/s",
                                (p["output_tokens_per_s"], p["itl_ms"]["p99"]), fontsize=7)
        w = result["workloads"][name]
        ax.set_title(f"{name} (positions bound {w['positions_bound']:.2f}x, FLOPs ratio "
                     f"{w['flops_ratio']:.2f}x)")
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel("p99 inter-token latency (ms)")
        ax.set_yscale("log")
        ax.legend()
    fig.suptitle(result["title"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(result: dict[str, Any]) -> str:
    lines = [result["title"], "", f"Note: {result['note']}", "",
             "| workload | p99 ITL objective ms | continuous tok/s | static tok/s "
             "| continuous / static | positions bound | FLOPs ratio | transformers generate "
             "tok/s (in-process) | continuous / generate |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def cell(v: dict[str, float] | None, unit: str = "") -> str:
        if v is None:
            return "-"
        return f"{v['median']:.2f}{unit} [{v['min']:.2f} .. {v['max']:.2f}]"

    for name, w in result["workloads"].items():
        for row in w["equal_itl"]:
            lines.append(f"| {name} | {row['objective_ms']:g} | {cell(row['continuous'])} | "
                         f"{cell(row['static'])} | {cell(row['ratio'], 'x')} | "
                         f"{w['positions_bound']:.2f}x | {w['flops_ratio']:.2f}x | "
                         f"{cell(row[HF])} | {cell(row['ratio_hf'], 'x')} |")
    lines += ["", "Every rate's throughput, ITL, TTFT and end-to-end latency percentiles are in "
              "the JSON.", "", f"Command: `{result['command']}`", ""]
    return "\n".join(lines)


def arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--positions", type=int, default=1024)
    ap.add_argument("--dtype", choices=("auto", "float32", "bf16"), default="auto")
    ap.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 2.0, 4.0])
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per rate")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--max-seqs", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=0,
                    help="continuous: generation.max_prefill_tokens (0: none, the default)")
    ap.add_argument("--repeats", type=int, default=1, help="sweeps, each rate's pair in turn")
    ap.add_argument("--hf", action="store_true",
                    help="also transformers' generate on the same weights, in-process")
    ap.add_argument("--itl-objectives", type=float, nargs="+", default=[200.0, 500.0, 1000.0])
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--note", default="")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    a = ap.parse_args()
    if a.dtype == "auto":
        a.dtype = "bf16" if has_amx() else "float32"
    return a


def has_amx() -> bool:
    """torch's CPU capability says AMX on builds that dispatch to it; on others (this torch
    reports "AVX512" on an AMX Xeon) the kernel's CPU flags tell (oneDNN uses AMX for bf16)."""
    if "AMX" in torch.backends.cpu.get_cpu_capability():
        return True
    try:
        return "amx_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def main() -> None:
    a = arguments()
    load_before = os.getloadavg()[0]
    result: dict[str, Any] = {"benchmark": "llm_serving_http", "workloads": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        export, params = make_export(work, a)
        curves: dict[str, list[dict[str, list[dict[str, Any]]]]] = {w: [] for w in a.workloads}
        # Both servers up at once (an idle one sleeps), each rate run on one then the other
        # back to back (the first mode alternating between repetitions): a shared machine's
        # load changes between them less than between sweeps.
        servers = {mode: serve(export, work, a, static=mode == "static") for mode in MODES}
        hf = hf_model(work, a) if a.hf else None
        try:
            for rep in range(a.repeats):
                for name in a.workloads:
                    sweep: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
                    curves[name].append(sweep)
                    for rate in a.rates:
                        for mode in MODES[rep % 2 :] + MODES[: rep % 2]:
                            sweep[mode].append(point(servers[mode][1], a, name, rate))
                        if hf is not None:  # while both servers idle
                            sweep.setdefault(HF, []).append(hf_point(hf, a, name, rate))
                        if all(saturated(sweep[m][-1], a) for m in MODES):
                            break
        finally:
            for server, _ in servers.values():
                server.terminate()
                server.wait(60)
    for name in a.workloads:
        prompt, output = WORKLOADS[name]
        result["workloads"][name] = {
            "prompt_lengths": prompt.describe(),
            "output_lengths": output.describe(),
            "positions_bound": positions_bound(prompt, output, a.max_seqs, a.seed),
            "flops_ratio": flops_ratio(prompt, output, a.max_seqs, a.seed,
                                       (a.n_layer, a.d_model, a.vocab)),
            "curves": curves[name],
            "equal_itl": [equal_itl_repeated(curves[name], o) for o in a.itl_objectives],
        }
    cpu = torch.backends.cpu.get_cpu_capability()
    result["title"] = (
        f"hpcml serve over HTTP, continuous vs static batching: GPT-2-sized model "
        f"({a.n_layer} layers, d_model {a.d_model}, vocabulary {a.vocab}, {params / 1e6:.0f}M "
        f"parameters, random weights, {a.dtype}), at most {a.max_seqs} sequences per step, "
        f"max_prefill_tokens {a.chunk or 'none'}, "
        f"{a.threads} torch thread(s), {a.duration:g} s of Poisson arrivals per rate; "
        f"{platform.processor() or platform.machine()} ({cpu}), {time.strftime('%Y-%m-%d')}"
    )
    result["note"] = (a.note + " " if a.note else "") + (
        f"1-minute load average {load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at "
        "the end (the machine was shared)."
    )
    result["machine"] = {"platform": platform.platform(), "cpus": os.cpu_count(),
                         "cpu_capability": cpu, "torch": torch.__version__}
    result["command"] = shlex.join(["python", "benchmarks/llm_serving_http.py", *sys.argv[1:]])
    name = "llm_serving_http" + (f"_{a.tag}" if a.tag else "")
    a.out_dir.mkdir(parents=True, exist_ok=True)
    (a.out_dir / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (a.out_dir / f"{name}.md").write_text(markdown(result))
    plot(result, a.out_dir / f"{name}.png")
    print(markdown(result))


if __name__ == "__main__":
    main()
