"""How each benchmark question's headline and spread are read from its result JSON: one small
function per result shape (the questions themselves are listed in questions.py)."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

Doc = dict[str, Any]
NONE = "–"


def x(v: float, digits: int = 2) -> str:
    return f"{v:.{digits}f}x"


def span(s: dict[str, float], digits: int = 2, unit: str = "x") -> str:
    """`lo–hi` of a {median, min, max} dict."""
    return f"{s['min']:.{digits}f}{unit}–{s['max']:.{digits}f}{unit}"


ADDED = ("added_within_run_s_per_checkpoint", "added_s_per_checkpoint")


def _added(d: Doc) -> str:
    """The key of the loop time added per checkpoint: the in-run estimate where recorded."""
    return next(k for k in ADDED if k in d["modes"]["sync"])


def ckpt(d: Doc) -> str:
    k, m, q = _added(d), d["modes"], d["over_sync"]
    a, low = q["async_nice0"], q["async_nice19"]
    how = " (in-run estimate)" if k != "added_s_per_checkpoint" else ""

    def added(mode: str) -> str:
        ratio = f" ({x(q[mode][k])} sync's)" if k in q[mode] else ""
        return f"{m[mode][k]['median']:.2f} s{ratio}"

    return (
        f"loop time added per checkpoint{how}: sync {m['sync'][k]['median']:.2f} s, async "
        f"{added('async_nice0')}, async with the writer at nice 19 {added('async_nice19')}; "
        f"async blocks the loop {x(a['stall_s'])} sync's time and is durable after "
        f"{x(a['durable_s'])} ({x(low['durable_s'])} at nice 19)"
    )


def ckpt_spread(d: Doc) -> str:
    k, m = _added(d), d["modes"]
    return (
        f"added per checkpoint over {d['rounds']} rounds: sync {span(m['sync'][k], 2, ' s')}, "
        f"async {span(m['async_nice0'][k], 2, ' s')}"
    )


def ckpt_readme(d: Doc) -> str:
    return (
        f"{ckpt(d)} ({ckpt_spread(d)}; 2 shared cores, load "
        f"{d['load_1m']['min']:.0f}-{d['load_1m']['max']:.0f})"
    )


def verify(d: Doc) -> str:
    return "resume start-up, each rank its files once / rank 0 three passes: " + ", ".join(
        f"{x(1 / r['speedup_after_vs_before'])} at {r['size_mb']} MiB" for r in d["rows"]
    )


def verify_spread(d: Doc) -> str:
    r = d["rows"][-1]
    return f"{r['size_mb']} MiB after: {r['min_s']['after']:.2f}–{r['max_s']['after']:.2f} s ({d['reps']} reps)"


def loader(d: Doc) -> str:
    return f"data wait {d['demo']['data_wait_share']:.2%} of the step (digits demo)"


def shards(d: Doc) -> str:
    s = d["shards"]
    return (
        f"shard bytes fetched per epoch / set: {x(s['s3']['fetched_per_epoch_over_dataset'])} "
        f"(S3), {x(s['s3_cache']['fetched_per_epoch_over_dataset'])} with the cache; data wait "
        f"{s['local']['data_wait_share']:.2%} of the step (local)"
    )


def augment(d: Doc) -> str:
    return ", ".join(f"{k}: {x(v)}" for k, v in d["ratios"].items())


def drift(d: Doc) -> str:
    return (
        f"{d['observe_per_request_us']['median']:.2f} µs per request observed; "
        f"{d['check_ms']['median']:.0f} ms per check"
    )


def drift_spread(d: Doc) -> str:
    return f"check {span(d['check_ms'], 0, ' ms')}"


def _fabric(d: Doc) -> str:
    r = d["median_ratios"]
    if "hpcml_over_fabric" in r:
        return (
            f"hpcml / Lightning Fabric {x(r['hpcml_over_fabric'])} (in the loop), "
            f"{x(r['wall_hpcml_over_fabric'])} (whole process)"
        )
    return "Lightning Fabric not in this run"


def engine(d: Doc) -> str:
    r = d["median_ratios"]
    return (
        f"hpcml / hand-written loop {x(r['hpcml_over_plain'])} (samples/s in the loop), "
        f"{x(r['wall_hpcml_over_plain'])} (whole process); {_fabric(d)}"
    )


def engine_spread(d: Doc) -> str:
    i = d["median_ratio_intervals_95"]
    lo, hi = i["hpcml_over_plain"]
    return f"95% interval of the first {lo:.2f}–{hi:.2f} ({d['rounds']} rounds)"


def engine_readme(d: Doc) -> str:
    i = d["median_ratio_intervals_95"]
    load = d.get("load_average")
    where = (
        f"load average {load['start']}–{load['end']}"
        if load
        else "a machine shared with other jobs"
    )
    spans = ", ".join(f"{lo:.2f}–{hi:.2f}" for lo, hi in i.values())
    return (
        f"{engine(d)}; not resolved to +-1%: 95% intervals {spans} after {d['rounds']} rounds "
        f"({d['date']}, 2 cores, {where}); the goal is >= 0.99x the loop and >= Fabric"
    )


def plan_trace(d: Doc) -> str:
    rows = d["rows"]
    traced = [r["traced_over_measured"] for r in rows]
    formula = [r["formula_over_measured"] for r in rows]
    return (
        f"traced / measured peak {min(traced):.3f}–{max(traced):.3f} over {len(rows)} steps "
        f"(formula path {min(formula):.3f}–{max(formula):.3f})"
    )


def finetune(d: Doc) -> str:
    r = d["lora_over_full"]
    return (
        f"LoRA / full: checkpoint {x(r['checkpoint_bytes'], 3)}, model states "
        f"{x(r['model_states_bytes'])}, val loss {x(r['val_loss'])}"
    )


def goals(d: Doc) -> str:
    return "; ".join(f"{k}: {x(v['ratio'], 3)}" for k, v in d["goals"].items())


def quant_bases(d: Doc) -> str:
    a, b = d["lora_int8_over_lora"], d["lora_nf4_over_lora"]
    return (
        f"model states over fp32 LoRA: int8 base {x(a['model_states_bytes'])}, nf4 base "
        f"{x(b['model_states_bytes'])}; val loss {x(a['val_loss'], 4)} / {x(b['val_loss'], 4)}"
    )


def admission(d: Doc) -> str:
    worst = max(d["rows"], key=lambda r: r["positions_over_ideal"])
    return (
        f"positions computed / ideal at most {x(worst['positions_over_ideal'])} "
        f"(kv_overcommit {worst['kv_overcommit']}, {worst['kv_cache_blocks']} blocks)"
    )


def attention(d: Doc) -> str:
    return (
        f"decode step time {x(d['time_ratio'])} for {x(d['positions_ratio'])} the positions "
        f"(bound {x(d['bound'])})"
    )


def kv_gather(d: Doc) -> str:
    return "; ".join(
        f"{r['model']} {r['dtype']}: decode step gathered / in place "
        f"{x(r['gather_over_in_place']['median'])}"
        for r in d["sizes"]
    )


def kv_gather_spread(d: Doc) -> str:
    return ", ".join(
        f"{r['model']} {span(r['gather_over_in_place'])} over {len(r['rounds'])} paired rounds "
        f"(load {r['load_1min']['min']:.1f}-{r['load_1min']['max']:.1f})"
        for r in d["sizes"]
    )


def hf_generate(d: Doc) -> str:
    return ", ".join(f"{k} {x(v)}" for k, v in d["ratios_of_medians"].items())


def quantize(d: Doc) -> str:
    p = d["perplexity"]
    return (
        f"int8 / fp32 tokens/s {x(d['int8_over_fp32_tokens_per_s'])}; perplexity "
        f"{p['int8']:.3f} vs {p['fp32']:.3f}"
    )


def llm_ratios(d: Doc, peer: str) -> tuple[float, float]:
    r = [row["ratio"][peer] for row in d["equal_itl"]]
    return min(r), max(r)


def llm(d: Doc) -> str:
    s, g = llm_ratios(d, "static"), llm_ratios(d, "hf-generate")
    return (
        f"continuous batching tokens/s at equal p99 ITL: {x(s[0])}–{x(s[1])} static batching, "
        f"{x(g[0])}–{x(g[1])} transformers' generate"
    )


def llm_spread(d: Doc) -> str:
    return f"range over {len(d['equal_itl'])} ITL objectives; {d['repeats']} repeats each"


def llm_readme(d: Doc) -> str:
    s, g = llm_ratios(d, "static"), llm_ratios(d, "hf-generate")
    return (
        f"{x(s[0])}–{x(s[1])} static batching, {x(g[0])}–{x(g[1])} `generate` (the 3x goal is "
        "not met on a CPU: the token positions computed bound it)"
    )


def http_ratio(d: Doc, workload: str) -> dict[str, float]:
    """Per-repetition continuous / static ratios at the loosest ITL objective."""
    r = [rep["ratio"] for rep in d["workloads"][workload]["equal_itl"][-1]["repetitions"]]
    return {"median": statistics.median(r), "min": min(r), "max": max(r)}


def http(d: Doc) -> str:
    return "continuous / static tokens/s at equal p99 ITL: " + ", ".join(
        f"{w} {x(http_ratio(d, w)['median'])}" for w in d["workloads"]
    )


def http_spread(d: Doc) -> str:
    return ", ".join(f"{w} {span(http_ratio(d, w))}" for w in d["workloads"]) + " over repetitions"


def http_readme(d: Doc) -> str:
    lt, un = http_ratio(d, "long-tailed"), http_ratio(d, "uniform")
    bound = d["workloads"]["long-tailed"]["positions_bound"]
    ub = d["workloads"]["uniform"]["positions_bound"]
    share = lt["median"] / bound

    def met(ok: bool) -> str:
        return "met" if ok else "not met"

    return (
        f"long-tailed {x(lt['median'])} [{x(lt['min'])} .. {x(lt['max'])}] static batching "
        f"(positions bound {x(bound)}: {share:.1%} of it), uniform {x(un['median'])} (bound "
        f"{x(ub)}); goals on the long-tailed workload: >= 2x {met(lt['median'] >= 2)}, within "
        f"10% of the bound {met(share >= 0.9)}"
    )


def step_profile(d: Doc) -> str:
    w = d["work_ratios"]
    steps = f", decode steps {x(w['steps'])}" if "steps" in w else ""
    return f"static / continuous work: positions {x(w['positions'])}, FLOPs {x(w['flops'])}{steps}"


def metrics(d: Doc) -> str:
    return f"samples/s with metrics on / off {x(d['median_ratio'])}"


def metrics_spread(d: Doc) -> str:
    return f"{d['ratio_min']:.2f}–{d['ratio_max']:.2f} over pairs"


def activations(d: Doc) -> str:
    r = [row["ratio"] for row in d["rows"]]
    return f"saved activations predicted / measured {min(r):.3f}–{max(r):.3f} over {len(r)} models"


def plan_counts(d: Doc) -> tuple[int, int, int]:
    n = len(d["rows"])
    memory = n - d["misses"]["states_plus_activations_bytes"]
    step = n - d["misses"]["step_time_s"]
    return n, memory, step


def plan(d: Doc) -> str:
    n, memory, step = plan_counts(d)
    g = d["goals"]
    line = f"memory within {g['memory']:.0%} in {memory}/{n}; step time "
    c = (d.get("step_time_summary") or {}).get("model out")
    if c is None:  # a result from before step times had intervals
        return line + f"within {g['step_time']:.0%} in {step}/{n}"
    return line + (
        f"inside its 90% interval in {c['inside']}/{c['runs_with_interval']}, median error "
        f"{c['median_abs_error']:.1%}"
    )


def plan_readme(d: Doc) -> str:
    if "step_time_summary" not in d:
        return plan(d) + " (the goal is every row; out of this model's reach)"
    return plan(d) + " (goals: >= 90% inside, median error <= 15%)"


def profile(d: Doc) -> str:
    return ", ".join(f"{r['variant']} {x(r['vs_baseline'])}" for r in d["rows"][1:]) + " step time"


def serving_goal(d: Doc, p99: str, key: str) -> dict[str, float]:
    return d["summary"][p99]["ratios"][key]


def serving(d: Doc) -> str:
    peer = [x(serving_goal(d, p, "hpcml_vs_best_peer")["median"]) for p in ("50", "100")]
    return f"capacity at p99 ≤ 50 / 100 ms vs the best peer (JSON): {peer[0]} / {peer[1]}"


def serving_spread(d: Doc) -> str:
    return f"{span(serving_goal(d, '50', 'hpcml_vs_best_peer'))} at 50 ms ({d['repeats']} repeats)"


def serving_readme(d: Doc) -> str:
    def pair(key: str) -> str:
        return " / ".join(x(serving_goal(d, p, key)["median"]) for p in ("50", "100"))

    raw = " / ".join(
        x(d["summary"][p]["vs_raw_forward"]["hpcml-batched"]["median"]) for p in ("50", "100")
    )
    return (
        f"{pair('hpcml_vs_best_peer')} the best peer with JSON; dynamic batching "
        f"{pair('batched_vs_bs1')} batch 1 with JSON, {pair('batched_vs_bs1_binary')} with "
        f"binary tensors; {raw} of the raw batched forward (goal 0.5x: not met, the load generator "
        "shares the 2 cores). Medians of per-repetition ratios; every capacity is a lower bound "
        "(the load generator lagged above it); Ray Serve not measured in this run"
    )


def budget(d: Doc) -> str:
    s = d["summary"]
    return "event-loop CPU ms per request: " + ", ".join(
        f"{k} {v['event_loop_ms']:.2f}" for k, v in s.items()
    )


def serving_cpu(d: Doc) -> str:
    return "event-loop CPU per request, this / baseline tree: " + ", ".join(
        f"{k} {x(v['this']['median'] / v['baseline']['median'])}" for k, v in d["summary"].items()
    )


def strategies(d: Doc) -> str:
    z = d["results"]["zero3"]
    return f"zero3 / ddp: bytes per rank {x(z['model_states_vs_ddp'])}, throughput {x(z['throughput_vs_ddp'])}"


def strategies_readme(d: Doc) -> str:
    z = d["results"]["zero3"]
    return (
        f"zero3 holds {x(z['model_states_vs_ddp'])} ddp's bytes per rank at "
        f"{x(z['throughput_vs_ddp'])} its speed"
    )


def tracking(d: Doc) -> str:
    c = d["cli"]["on"]
    return (
        f"`hpcml train` with tracking on / off: wall {x(c['wall_ratio'])}, CPU {x(c['cpu_ratio'])}"
    )


def tune(d: Doc) -> str:
    def times(c: Doc) -> str:
        per = c["ratio"]["time_ratio"]
        values = per.get("per_seed")
        if values is None:  # every seed got there: a spread
            return f"median {x(per['median'])} ({span(per)})"
        return ", ".join("not reached" if t is None else x(t) for t in values)

    s, seeds = d["summary"], len(d["runs"]["random, no pruning"])
    arms = "; ".join(
        f"{arm} {times(c)} (goal <= 0.5x met for {c['goal_met_seeds']} of {seeds})"
        for arm, c in d["compared"].items()
    )
    best = ", ".join(f"{arm} {v['best_val_accuracy']['median']:.3f}" for arm, v in s.items())
    itself = d.get("random_itself")
    luck = (
        f"; random search against itself (luck alone) {', '.join(x(t) for t in itself['time_ratio'])}"
        f" (<= 0.5x for {itself['at_most_half']} of {seeds})"
        if itself else ""
    )
    return (
        f"time to random search's best / random's time over the seeds: {arms}{luck}; best val "
        f"accuracy {best} at an equal budget of {d['budget']} training {d['budget_unit']}"
    )


def tune_startup(d: Doc) -> str:
    s = d["startup"]["summary"]
    return (
        f"a 1-step trial's CPU, warm / cold: "
        f"{x(s['warm trial alone']['cpu_s']['median'] / s['cold trial alone']['cpu_s']['median'])}"
    )


def repeats(key: str, what: str = "repeats") -> Callable[[Doc], str]:
    return lambda d: f"{d[key]} {what}" if key in d else NONE


def no_spread(why: str) -> Callable[[Doc], str]:
    return lambda d: why
