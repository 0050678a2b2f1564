"""The saved-activation probe tells storages apart by identity, not by data address.

FSDP2 frees a gathered weight's memory after its layer's forward although autograd saved it,
and the allocator may give that address to the next tensor of the size. Keyed by address,
the probe counted such an activation as a weight on one CI machine and not on another. The
allocator's reuse is chance, so here the second layer's activation is put at the weight's
address on purpose: both are views of one Python buffer (`torch.frombuffer`), two storages
with one data address, which is what the allocator's reuse looks like to the probe.
"""

from __future__ import annotations

import torch
from torch import nn

from hpcml.train.memprobe import SavedActivationProbe

N = 128  # 128 x 128 fp32 = 64 KiB, the size of the misclassified activation on CI


class Weighted(nn.Module):
    def __init__(self, memory: bytearray) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.frombuffer(memory, dtype=torch.float32).view(N, N))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


class AtTheWeightsAddress(nn.Module):
    def __init__(self, memory: bytearray) -> None:
        super().__init__()
        self.memory = memory

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = torch.frombuffer(self.memory, dtype=torch.float32).view(N, N).requires_grad_()
        return x * t  # autograd saves t, an activation in its own storage


def test_an_activation_at_a_weights_address_is_an_activation() -> None:
    memory = bytearray(N * N * 4)
    first, second = Weighted(memory), AtTheWeightsAddress(memory)
    assert first.weight.data_ptr() == torch.frombuffer(memory, dtype=torch.float32).data_ptr()
    x = torch.randn(N, N, generator=torch.Generator().manual_seed(1), requires_grad=True)
    probe = SavedActivationProbe(nn.Sequential(first, second))
    with probe.sample():
        second(first(x))
    got = probe.result(torch.device("cpu"))
    size = N * N * 4
    # The matmul saves x and the weight; the product saves its inputs y and t.
    assert got["saved_param_bytes"] == size
    assert got["saved_activation_bytes"] == 3 * size
