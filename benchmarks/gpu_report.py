"""The markdown table of `make gpu` (benchmarks/gpu_proof.py): one line per claim, from the
report it rewrites after every stage; a stage that did not finish says so on its row."""

from __future__ import annotations

from typing import Any


def _n(x: Any, fmt: str = ",.0f") -> str:
    return "-" if x is None else format(x, fmt)


def _env_lines(env: dict[str, Any]) -> list[str]:
    dev = env.get("device", {})
    return [
        f"Device: {dev.get('name', 'none (dry rehearsal on the CPU)')}; nvidia-smi: "
        f"{env.get('nvidia_smi', '-')}; torch {env.get('torch')}, CUDA {env.get('cuda')}, "
        f"cuDNN {env.get('cudnn')}, triton {env.get('triton')}, Python {env.get('python')}.",
        *([f"Missing modules: {env['missing_modules']}."] if env.get("missing_modules") else []),
    ]


def _gpt_rows(g: dict[str, Any]) -> list[str]:
    rows = []
    for name in ("eager", "compiled"):
        r = g[name]
        syncs = r["host_syncs_per_step"]
        most = max(syncs.values()) if syncs else None
        rows.append(
            f"| gpt2-small bf16 SDPA, {name} | {_n(r['tokens_per_s'])} tokens/s, MFU "
            f"{_n(r['mfu'], '.1%')} | host syncs per steady-state step: max {_n(most)} over "
            f"{len(syncs)} steps |"
        )
    rows.append(f"| compile speedup (tokens/s) | {g['compile_speedup']:.2f}x | eager as baseline |")
    return rows


def _cnn_rows(c: dict[str, Any]) -> list[str]:
    rows = []
    for name, h in c["hpcml"].items():
        loop = c["hand_loop"][name]["samples_per_s"]
        rows.append(
            f"| SimpleCNN {name.replace('_', ' ')} | hpcml {_n(h['samples_per_s'])} samples/s "
            f"| hand loop {_n(loop)} samples/s: hpcml {h['vs_hand_loop']:.2f}x |"
        )
    rows.append(f"| SimpleCNN bf16+CL+compile / fp32 (hpcml) | {c['fast_vs_fp32_hpcml']:.2f}x | |")
    return rows


def _memory_rows(m: dict[str, Any]) -> list[str]:
    return [
        f"| planner peak vs measured, {name} | predicted {_n(r['planned_peak_bytes'])} B | "
        f"max_memory_allocated {_n(r['peak_allocated_bytes'])} B: ratio "
        f"{_n(r['planned_over_measured'], '.3f')} |"
        for name, r in m["runs"].items()
    ]


def _llm_rows(s: dict[str, Any]) -> list[str]:
    rows = []
    for row in s["equal_itl"]:
        ratio = row["ratio"].get("static")
        cont, stat = row.get("continuous"), row.get("static")
        rows.append(
            f"| LLM continuous / static at p99 ITL <= {row['itl_p99_objective_ms']:g} ms | "
            f"{_n(ratio, '.2f')}x | continuous {_n(cont and cont['output_tokens_per_s'])} "
            f"tok/s, static {_n(stat and stat['output_tokens_per_s'])} tok/s |"
        )
    return rows


def _serving_rows(s: dict[str, Any]) -> list[str]:
    return [
        f"| serve capacity / raw batched forward ({s['model']}, p99 <= {s['slo_p99_ms']:g} ms) "
        f"| {s['capacity_over_raw']:.3f} | {_n(s['capacity_requests_per_s'])} req/s vs "
        f"{_n(s['raw_forward_samples_per_s'])} samples/s |"
    ]


def _pytest_rows(p: dict[str, Any]) -> list[str]:
    if "tests" not in p:
        return [f"| pytest -m gpu | rc {p['rc']} | collected only (dry) |"]
    passed = p["tests"] - p["failures"] - p["errors"] - p["skipped"]
    return [
        f"| pytest -m gpu | {passed} passed, {p['failures'] + p['errors']} failed, "
        f"{p['skipped']} skipped | {', '.join(p['failed']) or 'none failed'} |"
    ]


def _checkpoint_rows(c: dict[str, Any]) -> list[str]:
    rows = []
    for mode, r in c["modes"].items():
        rows.append(
            f"| checkpoint {mode}: loop time added per checkpoint | "
            f"{_n(r['added_s_per_checkpoint']['median'], '.3f')} s | stall "
            f"{_n(r['stall_s']['median'], '.3f')} s, durable after "
            f"{_n(r['durable_s']['median'], '.3f')} s ({_n(c['checkpoint_bytes'])} B) |"
        )
    return rows


ROWS = {
    "checkpoint": _checkpoint_rows,
    "pytest": _pytest_rows,
    "gpt": _gpt_rows,
    "cnn": _cnn_rows,
    "memory": _memory_rows,
    "llm": _llm_rows,
    "serving": _serving_rows,
}


def markdown(report: dict[str, Any]) -> str:
    stages = report["stages"]
    lines = [
        f"# make gpu{' (dry rehearsal: no CUDA device)' if report['dry'] else ''}",
        "",
        f"Commit {report.get('commit')}, started {report['started']}; command "
        f"`{report['command']}`.",
        "",
    ]
    if stages.get("env", {}).get("status") == "ok":
        lines += _env_lines(stages["env"]) + [""]
    lines += ["| claim | measured | beside it |", "|---|---|---|"]
    for name, stage in stages.items():
        if name == "env":
            continue
        if stage.get("status") != "ok":
            why = stage.get("reason") or f"rc {stage.get('rc')}: {(stage.get('tail') or [''])[-1]}"
            lines.append(f"| {name} | **{stage.get('status')}** | {why} |")
            continue
        try:
            lines += ROWS[name](stage)
        except (KeyError, TypeError, ZeroDivisionError) as exc:
            lines.append(f"| {name} | result unreadable | {type(exc).__name__}: {exc} |")
    lines += ["", "| stage | status | seconds |", "|---|---|---:|"]
    lines += [
        f"| {name} | {s.get('status')} | {_n(s.get('seconds'), '.0f')} |"
        for name, s in stages.items()
    ]
    return "\n".join(lines) + "\n"
