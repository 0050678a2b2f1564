"""Fault injection for tests and chaos drills (HPCML_FAULT_INJECT), split from hpcml.train.fault.guard."""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import torch

from hpcml.errors import ConfigError

__all__ = ["INJECT_ENV", "FaultInjector"]

INJECT_ENV = "HPCML_FAULT_INJECT"


class FaultInjector:
    """Faults injected through the model's forward hooks, read from HPCML_FAULT_INJECT (JSON):

    {"slow":  {"rank": 1, "seconds": 0.05}}               every training forward on rank 1
    {"slow_backward": {"rank": 1, "seconds": 0.05}}       every training backward on rank 1 (a
                                                          hook on the output's gradient: the
                                                          forward is not delayed)
    {"stall": {"rank": 1, "step": 5, "seconds": 3600}}    once, at step 5 (a hang)
    {"nan":   {"step": 7, "rank": 0}}                     once: that forward's output becomes NaN
    {"spike": {"step": 30, "scale": 100.0}}               once: output x -scale (confidently
                                                          wrong logits, a large loss)
    {"ckpt_stall": {"rank": 0, "phase": "fsync", "step": 10, "seconds": 3600}}
                                                          once: that checkpoint phase hangs
                                                          (a hung filesystem); "step" left out
                                                          means the first save
    {"ckpt_kill": {"rank": 0, "phase": "rename", "step": 10}}
                                                          kill -9 of this process as that
                                                          phase of that save begins (or at a
                                                          point: "renamed", "pruning"; see
                                                          ckpt_phase); a list: entry i for
                                                          elastic attempt i
                                                          (TORCHELASTIC_RESTART_COUNT)

    Steps are 1-based optimizer steps; "rank" left out means every rank.
    """

    def __init__(self, spec: dict[str, Any], rank: int) -> None:
        known = {"slow", "slow_backward", "stall", "nan", "spike", "ckpt_stall", "ckpt_kill"}
        unknown = set(spec) - known
        if unknown:
            raise ConfigError(
                f"{INJECT_ENV} names unknown faults {sorted(unknown)}; known are {sorted(known)}."
            )
        self.rank = rank
        kill = spec.get("ckpt_kill")
        if isinstance(kill, list):  # one drill per elastic attempt
            attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
            spec = {k: v for k, v in spec.items() if k != "ckpt_kill"}
            if attempt < len(kill) and kill[attempt]:
                spec["ckpt_kill"] = kill[attempt]
        self.spec = {k: v for k, v in spec.items() if v.get("rank", rank) == rank}
        self.fired: set[str] = set()

    @classmethod
    def from_env(cls, rank: int) -> FaultInjector | None:
        raw = os.environ.get(INJECT_ENV)
        if not raw:
            return None
        try:
            spec = json.loads(raw)
        except json.JSONDecodeError:
            raise ConfigError(f"{INJECT_ENV} is not valid JSON: {raw[:100]!r}.") from None
        return cls(spec, rank)

    def _once(self, name: str, step: int) -> bool:
        s = self.spec.get(name)
        if s is None or name in self.fired or int(s["step"]) != step:
            return False
        self.fired.add(name)
        return True

    def checkpoint_phase(self, name: str, step: int) -> None:
        """ckpt_phase.hook: sleep in the named phase of a save (once), or die there."""
        kill = self.spec.get("ckpt_kill")
        if kill is not None and kill.get("phase") == name and int(kill["step"]) == step:
            os.kill(os.getpid(), signal.SIGKILL)
        s = self.spec.get("ckpt_stall")
        if s is None or "ckpt_stall" in self.fired or s.get("phase") != name:
            return
        if "step" in s and int(s["step"]) != step:
            return
        self.fired.add("ckpt_stall")
        time.sleep(float(s.get("seconds", 3600)))

    def before_forward(self, step: int) -> None:
        if "slow" in self.spec:
            time.sleep(float(self.spec["slow"]["seconds"]))
        if self._once("stall", step):
            time.sleep(float(self.spec["stall"].get("seconds", 3600)))

    def after_forward(self, output: Any, step: int) -> Any:
        slow = self.spec.get("slow_backward")
        if slow is not None and isinstance(output, torch.Tensor) and output.requires_grad:
            seconds = float(slow["seconds"])

            def delay(grad: torch.Tensor) -> torch.Tensor:
                time.sleep(seconds)  # runs inside backward, before any parameter's gradient
                return grad

            output.register_hook(delay)
        if self._once("nan", step):
            return output * float("nan")
        if self._once("spike", step):
            return output * -float(self.spec["spike"].get("scale", 100.0))
        return output
