"""The training stages of `make gpu` (benchmarks/gpu_proof.py runs each in its own process
under `timeout`): each measures a GPU claim beside its baseline in the same invocation.

  cnn     SimpleCNN samples/s: a hand-written loop (fp32 eager, and bf16 + channels_last +
          compile) on a batch held on the device, beside `hpcml train` with each setting.
  gpt     gpt2-small through hpcml's Trainer (bf16, SDPA): eager vs compiled tokens/s and MFU,
          and the host syncs of the steady-state steps counted under
          `torch.cuda.set_sync_debug_mode("warn")` (steps that flush the log excluded).
  memory  the planner's predicted peak vs `torch.cuda.max_memory_allocated` over the training
          steps (evaluation's peak apart) for gpt2-small with and without activation
          checkpointing and the cnn stage's runs (each run's summary holds both).
  checkpoint  issue 40's question on the GPU: what a sync vs an async checkpoint adds to the
          run, the loop's stall and the time until durable (benchmarks/checkpoint_stall.py's
          runs and summary, 2 rounds; the copy to host is what async hides on a GPU).

Dry mode (no CUDA device: `make gpu` on a CPU machine) runs the same functions on the CPU at
toy sizes up to the point where a device is needed, and says with one line what it skipped,
so the suite exercises this file and it cannot rot. Each stage returns a JSON-able dict.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from hpcml.train.hooks import Hook  # noqa: E402  (after the path above)


def say(msg: str) -> None:
    print(msg, flush=True)


def hand_loop_samples_per_s(
    dev: torch.device, batch: int, steps: int, fast: bool, dry: bool
) -> dict[str, Any]:
    """SimpleCNN trained by a plain loop on one batch already on the device: the model's own
    speed, the ceiling hpcml's loop is compared with. `fast`: bf16 autocast + channels_last +
    torch.compile."""
    import torch.nn.functional as F

    from hpcml.models.zoo import build_model

    torch.manual_seed(0)
    model = build_model("simple_cnn", {}).to(dev)
    x = torch.randn(batch, 3, 32, 32, device=dev)
    y = torch.randint(0, 10, (batch,), device=dev)
    compile_on = fast and not dry
    if fast:
        model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        x = x.contiguous(memory_format=torch.channels_last)
    if fast and dry:
        say("dry: torch.compile of the hand loop skipped (no CUDA device)")
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    step_model = torch.compile(model) if compile_on else model
    amp = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=fast)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with amp:
            loss = F.cross_entropy(step_model(x), y)
        loss.backward()
        opt.step()

    for _ in range(10 if compile_on else 3):  # compile and autotune before timing
        step()
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync(dev)
    seconds = time.perf_counter() - t0
    return {"batch": batch, "steps": steps, "samples_per_s": batch * steps / seconds}


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


CNN_CONFIG = {
    "model": {"name": "simple_cnn"},
    "data": {
        "source": "synthetic",
        "synthetic_samples": 65536,
        "synthetic_shape": [3, 32, 32],
        "batch_size": 1024,
        "num_workers": 4,
    },
    "train": {"max_steps": 60, "eval_every": 0, "log_every": 20, "checkpoint_every": 0},
    "optim": {"name": "sgd", "lr": 0.01},
}


def train_run(data: dict[str, Any], run_dir: Path, hooks: list[Any] | None = None) -> dict:
    """One `hpcml train` in this process (the Trainer the CLI runs): its summary.json."""
    from hpcml.config import build_config
    from hpcml.train.hooks import Hooks
    from hpcml.train.trainer import Trainer

    cfg = build_config(data, origin="gpu_proof")
    if torch.cuda.is_available():  # this run's peaks alone, not an earlier run's in the process
        import gc

        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    Trainer(cfg, run_dir=run_dir, overwrite=True, quiet=True, hooks=Hooks(hooks or [])).fit()
    return json.loads((run_dir / "summary.json").read_text())


def run_facts(s: dict[str, Any]) -> dict[str, Any]:
    thr, mem = s["throughput"], s["memory"]
    pred = {r["quantity"]: r for r in s.get("prediction", {}).get("rows", [])}
    peak = pred.get("peak_allocated_bytes")
    return {
        "samples_per_s": thr["samples_per_s"],
        "tokens_per_s": thr.get("tokens_per_s"),
        "mfu": thr["mfu"],
        "step_time_s": thr["step_time_s"],
        "data_wait_s": thr["data_wait_s"],
        "peak_allocated_bytes": mem["peak_allocated_bytes"],
        "eval_peak_allocated_bytes": mem.get("eval_peak_allocated_bytes"),
        "planned_peak_bytes": peak["predicted"] if peak else None,
        "device": s["device"],
    }


def stage_cnn(work: Path, dev: torch.device, dry: bool) -> dict[str, Any]:
    batch, steps = (32, 2) if dry else (1024, 100)
    out: dict[str, Any] = {"hand_loop": {}, "hpcml": {}}
    for name, fast in (("fp32_eager", False), ("bf16_channels_last_compile", True)):
        out["hand_loop"][name] = hand_loop_samples_per_s(dev, batch, steps, fast, dry)
        say(f"hand loop {name}: {out['hand_loop'][name]['samples_per_s']:,.0f} samples/s")
        data = json.loads(json.dumps(CNN_CONFIG))
        data["train"]["device"] = dev.type
        if fast:
            data["precision"] = "bf16"
            data["train"].update(channels_last=True, compile=not dry)
        if dry:
            data["data"].update(synthetic_samples=256, batch_size=32, num_workers=0)
            data["train"]["max_steps"] = 3
        s = train_run(data, work / f"cnn-{name}")
        out["hpcml"][name] = run_facts(s)
        say(f"hpcml train {name}: {out['hpcml'][name]['samples_per_s']:,.0f} samples/s")
    for name in out["hpcml"]:
        out["hpcml"][name]["vs_hand_loop"] = (
            out["hpcml"][name]["samples_per_s"] / out["hand_loop"][name]["samples_per_s"]
        )
    out["fast_vs_fp32_hpcml"] = (
        out["hpcml"]["bf16_channels_last_compile"]["samples_per_s"]
        / out["hpcml"]["fp32_eager"]["samples_per_s"]
    )
    return out


def random_tokens(folder: Path, vocab: int, n: int) -> Path:
    """nanoGPT-format uint16 files of uniform random tokens: speed does not depend on them."""
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for name, size in (("train.bin", n), ("val.bin", n // 10)):
        rng.integers(0, vocab, size, dtype=np.uint16).tofile(folder / name)
    (folder / "meta.json").write_text(json.dumps({"vocab_size": vocab, "tokenizer": "random"}))
    return folder


class SyncCounter(Hook):
    """A Trainer hook: host syncs per step, counted by CUDA's sync debug mode (every
    synchronizing call warns) in steps `first`..`last` that do not flush the log (a flush
    reads the loss: one sync by design, tests/integration/test_step_communication.py)."""

    rank_zero_only = False

    def __init__(self, first: int, last: int, log_every: int) -> None:
        self.first, self.last, self.log_every = first, last, log_every
        self.per_step: dict[int, int] = {}
        self.messages: list[str] = []
        self._catch: Any = None
        self._caught: list[Any] = []
        self._step: int | None = None

    def _close(self) -> None:
        if self._catch is None:
            return
        torch.cuda.set_sync_debug_mode(0)
        self._catch.__exit__(None, None, None)
        # "called a synchronizing CUDA operation": one per sync (the mode's own notice that
        # it is a prototype is not one).
        syncs = [w for w in self._caught if "called a synchronizing" in str(w.message)]
        assert self._step is not None
        self.per_step[self._step] = len(syncs)
        self.messages += [f"step {self._step}: {w.message}"[:300] for w in syncs[:3]]
        self._catch = None

    def before_step(self, trainer: Any) -> None:
        self._close()
        step = trainer.step + 1  # the step about to run
        if self.first <= step <= self.last and step % self.log_every:
            self._catch = warnings.catch_warnings(record=True)
            self._caught = self._catch.__enter__()
            warnings.simplefilter("always")
            self._step = step
            torch.cuda.set_sync_debug_mode("warn")


def gpt_config(data_path: Path, dev: torch.device, dry: bool, **train: Any) -> dict[str, Any]:
    model = {"name": "gpt2-small", "args": {"vocab_size": 50304}}
    seq, batch, steps = 1024, 16, 40
    if dry:
        model = {"name": "gpt-tiny", "args": {"vocab_size": 512, "n_layer": 2, "d_model": 64}}
        seq, batch, steps = 64, 2, 3
    return {
        "model": model,
        "data": {
            "source": "tokens",
            "path": str(data_path),
            "seq_len": seq,
            "batch_size": batch,
            "eval_windows": 2,
            "num_workers": 2,
        },
        "optim": {
            "name": "adamw",
            "lr": 6e-4,
            "betas": [0.9, 0.95],
            "weight_decay": 0.1,
            "warmup_steps": 5,
        },
        "train": {
            "max_steps": steps,
            "eval_every": 0,
            "log_every": 20,
            "checkpoint_every": 0,
            "device": dev.type,
            **train,
        },
        "precision": "bf16",
    }


def stage_gpt(work: Path, dev: torch.device, dry: bool) -> dict[str, Any]:
    tokens = random_tokens(work / "tokens", 512 if dry else 50304, 20_000 if dry else 5_000_000)
    out: dict[str, Any] = {}
    for name, compile_on in (("eager", False), ("compiled", True)):
        data = gpt_config(tokens, dev, dry, compile=compile_on and not dry)
        counter = SyncCounter(first=25, last=39, log_every=20)
        if dev.type != "cuda":
            say("dry: the sync count needs CUDA's sync debug mode; skipped")
        s = train_run(data, work / f"gpt-{name}", [counter] if dev.type == "cuda" else [])
        counter._close()
        out[name] = run_facts(s)
        out[name]["host_syncs_per_step"] = counter.per_step
        out[name]["sync_examples"] = counter.messages
        say(
            f"gpt {name}: {out[name]['tokens_per_s'] or 0:,.0f} tokens/s, MFU {out[name]['mfu']}, "
            f"syncs {counter.per_step}"
        )
    out["compile_speedup"] = out["compiled"]["tokens_per_s"] / out["eager"]["tokens_per_s"]
    out["config"] = {k: v for k, v in gpt_config(tokens, dev, dry).items() if k != "data"}
    return out


def stage_memory(work: Path, dev: torch.device, dry: bool) -> dict[str, Any]:
    """Predicted vs measured peak for the runs above and one more layout (gpt2-small with
    activation checkpointing of every block)."""
    tokens = work / "tokens"
    if not tokens.exists():
        random_tokens(tokens, 512 if dry else 50304, 20_000 if dry else 5_000_000)
    rows = {}
    for name, ac in (("gpt-eager", "none"), ("gpt-recompute", "full")):
        data = gpt_config(tokens, dev, dry, activation_checkpointing=ac, max_steps=3 if dry else 8)
        rows[name] = run_facts(train_run(data, work / "memory" / name))
    for path in sorted(work.glob("cnn/*/summary.json")):  # the cnn stage's runs, if any
        summary = json.loads(path.read_text())
        if summary.get("status") == "finished":  # a failed run's summary has no measurements
            rows[path.parent.name] = run_facts(summary)
    for r in rows.values():
        measured, planned = r["peak_allocated_bytes"], r["planned_peak_bytes"]
        r["planned_over_measured"] = planned / measured if measured and planned else None
    if dry:
        say("dry: no allocator peak on the CPU; predicted-vs-measured rows are empty")
    return {"runs": rows}


def stage_checkpoint(work: Path, dev: torch.device, dry: bool) -> dict[str, Any]:
    """Sync vs async checkpoints, side by side in rounds (checkpoint_stall.py's own runs)."""
    import checkpoint_stall as cs

    hidden, depth, steps, every = (64, 2, 6, 2) if dry else (4096, 4, 30, 10)
    overrides = [*cs.mlp_overrides(hidden, depth, 256, steps), f"train.device={dev.type}"]
    modes = ["sync", "async_nice0"]
    rounds = cs.run_rounds(overrides, modes, every, 1 if dry else 2)
    result = cs.summarize(rounds, modes)
    first = rounds[0]["sync"]
    result.update(
        params=first["params"],
        checkpoint_bytes=first["checkpoint_bytes"],
        steps=steps,
        every=every,
        rounds=len(rounds),
        runs=rounds,
    )
    for mode, r in result["modes"].items():
        say(
            f"checkpoint {mode}: added {r['added_s_per_checkpoint']['median']:.3f} s, stall "
            f"{r['stall_s']['median']:.3f} s, durable {r['durable_s']['median']:.3f} s"
        )
    return result


STAGES = {
    "cnn": stage_cnn,
    "gpt": stage_gpt,
    "memory": stage_memory,
    "checkpoint": stage_checkpoint,
}
