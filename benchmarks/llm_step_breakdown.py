"""Where a saturated engine step's time goes, by part of the engine (for llm_step_profile.py).

Every request is submitted at once; after a few warm-up steps, `k` steps run under plain
timers around the engine's parts (scheduling, the attention's per-step set-up, the model's
forward, sampling and bookkeeping) and under torch's profiler, whose top-level ops inside the
forward are sorted by kind: the layers' matmuls, the LM head (a matmul whose weight has the
vocabulary's rows), the KV cache's writes (`index_copy_`) and gathers (`index_select`),
attention (`scaled_dot_product_attention`) and the rest (norms, GELU, additions, copies); what
the forward's wall time holds beyond its ops is Python between them. The profiler adds a few
microseconds per op, so the parts are a little above an unprofiled step's.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from torch.profiler import ProfilerActivity, profile, record_function

import hpcml.serve.generate.engine as engine_module
from hpcml.models.gpt import GPT
from hpcml.serve.generate.engine import Engine, EngineConfig
from hpcml.serve.generate.sampling import SamplingParams

WARMUP = 8
OPS = {
    "aten::index_copy_": "KV write",
    "aten::index_select": "KV gather",
    "aten::scaled_dot_product_attention": "attention (SDPA)",
}
MATMULS = ("aten::linear", "aten::addmm", "aten::mm", "aten::matmul")


def _timed(fn: Callable[..., Any], spent: dict[str, float], part: str) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[part] += time.perf_counter() - t0

    return wrapper


def _op_kind(evt: Any, vocab_rows: int) -> str:
    if evt.name in MATMULS:
        shapes = evt.input_shapes or []
        head = any(len(s) == 2 and s[0] == vocab_rows for s in shapes)
        return "LM head" if head else "layers' matmuls"
    return OPS.get(evt.name, "other ops (norms, GELU, adds, copies)")


def breakdown(
    model: GPT, config: EngineConfig, requests: list[tuple[list[int], int]], k: int
) -> dict[str, float]:
    """ms per step of each part, over `k` saturated steps after `WARMUP` (see module doc)."""
    engine = Engine(model, config)
    for prompt, max_tokens in requests:
        engine.submit(prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
    for _ in range(WARMUP):
        engine.step()
    spent: dict[str, float] = defaultdict(float)
    forward = model.forward

    def labelled(*args: Any, **kwargs: Any) -> Any:
        with record_function("hpcml.forward"):
            return forward(*args, **kwargs)

    engine._plan_running = _timed(engine._plan_running, spent, "scheduling")  # type: ignore[method-assign]
    engine._admit = _timed(engine._admit, spent, "scheduling")  # type: ignore[method-assign]
    engine._advance = _timed(engine._advance, spent, "sampling and bookkeeping")  # type: ignore[method-assign]
    model.forward = _timed(labelled, spent, "forward")  # type: ignore[method-assign]
    setup = engine_module.StepAttention
    engine_module.StepAttention = _timed(setup, spent, "attention set-up")  # type: ignore[misc]
    totals: list[float] = []
    try:
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(k):
                t0 = time.perf_counter()
                engine.step()
                totals.append(time.perf_counter() - t0)
    finally:
        engine_module.StepAttention = setup  # type: ignore[misc]
        del model.forward
    kinds = ["layers' matmuls", "LM head", *OPS.values(), "other ops (norms, GELU, adds, copies)"]
    ops = dict.fromkeys(kinds, 0.0)
    for evt in prof.events():
        if evt.name == "hpcml.forward":
            for child in evt.cpu_children:
                ops[_op_kind(child, model.cfg.padded_vocab)] += child.cpu_time_total / 1e6
    in_ops = sum(ops.values())
    out = {"scheduling": spent["scheduling"], "attention set-up": spent["attention set-up"]}
    out |= ops
    out["forward: Python between ops"] = spent["forward"] - in_ops
    out["sampling and bookkeeping"] = spent["sampling and bookkeeping"]
    out = {part: 1e3 * s / k for part, s in out.items()}
    out["step (median)"] = 1e3 * statistics.median(totals)
    return out
