"""The device-side skip of a non-finite step on every optimizer path, with no host read.

Paths: the fused kernel (`found_inf`), the fused kernel over a model that mixes plain tensors
and DTensors (tensor parallelism leaves norms and the position table plain: one fused call
per kind), and an optimizer without a fused kernel (stepped, then put back with
`torch.where`). Host reads are counted with a TorchFunctionMode that sees every Python-level
`item`, `tolist`, `bool()`, `int()`, `float()` and `index` of a tensor, except those of
torch's own non-capturable optimizers, which read their step counts: tensors they keep on the
CPU (on a GPU `build_optimizer` makes them capturable, on the device, with no such read).
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.overrides import TorchFunctionMode

from hpcml.config import OptimConfig
from hpcml.train.schedule import build_optimizer, build_scheduler
from hpcml.train.update import optimizer_step

HOST_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
}


class HostReads(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN204
        if func in HOST_READS and "torch/optim/" not in sys._getframe(1).f_code.co_filename:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def one_rank_group() -> Iterator[None]:
    """A 1-process gloo group: DTensors need a mesh."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model(mixed: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    if mixed:  # the first layer as tensor parallelism leaves it: DTensors; the rest plain
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (1,))
        for name, p in list(model[0].named_parameters()):
            setattr(model[0], name, nn.Parameter(distribute_tensor(p.data, mesh, [Replicate()])))
    return model


def _grads(model: nn.Module, bad: bool) -> None:
    for i, p in enumerate(model.parameters()):
        g = torch.full_like(p, 0.1 * (i + 1))
        if bad and i == 0:
            g = g + float("inf")  # one parameter's gradient is Inf: the global norm too
        p.grad = g


def _state(model: nn.Module, opt: Any) -> list[torch.Tensor]:
    def plain(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()

    out = [plain(p) for p in model.parameters()]
    for p in model.parameters():
        out += [plain(v) for v in opt.state[p].values() if torch.is_tensor(v)]
    return out


def _step(model: nn.Module, opt: Any, bad: bool, reads: HostReads) -> torch.Tensor | None:
    from hpcml.distributed.parallel import grad_norm

    sched = build_scheduler(opt, OptimConfig(), 100)
    _grads(model, bad)
    norm = grad_norm(model)
    with reads:
        _, skipped = optimizer_step(
            model, opt, sched, torch.amp.GradScaler("cpu", enabled=False), 1.0, norm
        )
    return skipped


@pytest.mark.parametrize("path", ["fused", "mixed_kinds", "not_fused"])
def test_a_non_finite_step_is_dropped_on_the_device(one_rank_group: None, path: str) -> None:
    model = _model(mixed=path == "mixed_kinds")
    cfg = OptimConfig(name="adamw", lr=0.1, weight_decay=0.1)
    opt = build_optimizer(model.parameters(), cfg, 1, fused=False if path == "not_fused" else None)
    assert opt.defaults["fused"] is (path != "not_fused")  # main: mixed kinds not fused
    reads = HostReads()
    assert float(_step(model, opt, bad=False, reads=reads)) == 0.0  # a first, good step
    before = _state(model, opt)
    assert float(_step(model, opt, bad=True, reads=reads)) == 1.0
    after = _state(model, opt)
    assert len(after) == len(before) > len(list(model.parameters()))
    for a, b in zip(after, before, strict=True):
        assert torch.equal(a, b)  # parameters and moments and step counts, bit for bit
    assert reads.count == 0  # main: found_inf.item() on every step without a fused kernel


def test_the_kind_split_steps_as_one_fused_call_would(one_rank_group: None) -> None:
    """A finite step over mixed kinds equals the same step over plain tensors."""
    mixed, plain = _model(mixed=True), _model(mixed=False)
    cfg = OptimConfig(name="adamw", lr=0.1, weight_decay=0.1)
    opts = [build_optimizer(m.parameters(), cfg, 1) for m in (mixed, plain)]
    for _ in range(2):
        for m, o in zip((mixed, plain), opts, strict=True):
            _step(m, o, bad=False, reads=HostReads())
    for a, b in zip(_state(mixed, opts[0]), _state(plain, opts[1]), strict=True):
        assert torch.equal(a, b)
