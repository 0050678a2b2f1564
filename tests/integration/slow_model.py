"""A model that is slow by construction, on any machine: the zoo's MLP, whose forward pass
first sleeps `sleep_s`. Exported under its import path (`tests.integration.slow_model:build`),
it is served and promoted only with `--trust-code`, like any user architecture. Its answers
are the MLP's, so it scores as the MLP whose weights it carries; every request it answers
takes at least `sleep_s`, which puts its p99 latency above any SLO below that."""

from __future__ import annotations

import time
from typing import Any

import torch

from hpcml.models.cnn import MLP

NAME = "tests.integration.slow_model:build"


class SlowMLP(MLP):
    def __init__(self, sleep_s: float, **kw: Any) -> None:
        super().__init__(**kw)
        self.sleep_s = sleep_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.sleep_s)
        return super().forward(x)


def build(
    sleep_s: float = 1.0, input_shape: tuple[int, ...] | list[int] = (3, 32, 32), **kw: Any
) -> SlowMLP:
    n = 1
    for d in input_shape:
        n *= int(d)
    return SlowMLP(sleep_s, in_features=n, **kw)
