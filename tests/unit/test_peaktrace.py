"""hpcml.train.peaktrace: live tensor bytes of a real step, by allocation tracing.

A sequence of allocations whose peak is known to the byte: the tracer must count what exists
when it starts, follow frees, count a view as no new memory, and follow `resize_` (FSDP2's
gathered parameters), each of which a wrong tracer gets wrong by megabytes.
"""

from __future__ import annotations

import torch
from torch import nn

from hpcml.train.peaktrace import LiveBytes, StepPeak

MB4 = 1000 * 1000 * 4  # a 1000 x 1000 float32 tensor


def test_peak_follows_allocations_frees_views_and_resizes() -> None:
    weight = torch.zeros(1000, 1000)  # alive before: 4 MB
    dataset = torch.zeros(2000, 1000)  # alive before, not the step's: 8 MB never counted
    gathered = torch.UntypedStorage(0)  # an FSDP2-style storage, empty between steps
    tracer = LiveBytes()
    tracer.add_tensor(weight, "params")
    with tracer:
        a = torch.ones(1000, 1000)  # 8 MB alive
        view = dataset[:10]  # a view (of memory the step did not allocate): nothing new
        b = a * 2  # 12 MB: the first peak
        assert tracer.peak == 3 * MB4  # the view added nothing
        del a, view  # 8 MB
        c = b + 1  # 12 MB again, not more
        del b, c  # 4 MB
        gathered.resize_(4 * MB4)  # 20 MB: the peak
        gathered.resize_(0)  # 4 MB
        d = torch.ones(500, 1000)  # 6 MB
    assert tracer.peak == 5 * MB4
    assert tracer.at_peak["params"] == MB4 and tracer.at_peak["forward"] == 4 * MB4
    assert tracer.total == MB4 + MB4 // 2
    del d
    assert tracer.total == MB4  # freed after the step too, until forgotten
    tracer.forget()


def test_a_steady_step_is_traced_with_its_states_and_gradients() -> None:
    """The third step of a Linear under SGD with momentum: parameters, momentum and the
    previous step's gradient alive at its start; zero_grad frees that gradient before the
    forward, so the peak holds one gradient, not two."""
    torch.manual_seed(0)
    model = nn.Linear(1000, 1000, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)
    peak = StepPeak(model, opt, last=4, enabled=True)

    def step(n: int) -> None:
        with peak.step(n):
            opt.zero_grad(set_to_none=True)
            x = torch.randn(8, 1000)
            model(x).square().mean().backward()
            opt.step()

    for n in (1, 2, 3, 4):
        step(n)
    out = peak.result()
    assert out["traced_peak_step"] == 3
    # weight + momentum + one gradient, plus the 8 x 1000 input, output and its gradient
    # (32 KB each) and a few scalars: 12 MB and under 0.2 MB more.
    assert 3 * MB4 <= out["traced_peak_bytes"] < 3 * MB4 + 200_000
    assert out["traced_at_peak"]["params"] == MB4
    assert out["traced_at_peak"]["optimizer"] == MB4
    assert out["traced_at_peak"]["backward"] >= MB4  # the step's own gradient
    assert out["traced_at_peak"]["grads"] == 0  # the previous one was freed by zero_grad


def test_off_steps_are_not_traced() -> None:
    model = nn.Linear(4, 4)
    peak = StepPeak(model, torch.optim.SGD(model.parameters(), lr=0.1), last=3, enabled=False)
    for n in (1, 2, 3):
        with peak.step(n):
            model(torch.ones(1, 4)).sum().backward()
    assert peak.result() == {"traced_peak_bytes": None}


def test_an_output_it_cannot_read_ends_the_count_not_the_step() -> None:
    """A sparse tensor has no storage to follow: the count stops and says why, and the step
    it measured runs to its end (a measurement must never fail a run)."""
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    peak = StepPeak(model, opt, last=1, enabled=True)
    with peak.step(1):
        sparse = torch.sparse_coo_tensor(
            torch.tensor([[0, 2]]), torch.tensor([1.0, 2.0]), (4,), check_invariants=True
        )
        model(sparse.to_dense().unsqueeze(0)).sum().backward()
        opt.step()
    assert model.weight.grad is not None
    out = peak.result()
    assert out["traced_peak_bytes"] is None
    assert "Cannot access storage of SparseTensorImpl" in out["traced_peak_error"], out
