"""The background checkpoint writer: its thread's priority, and what a save's stall counts.

Real background saves (torch.distributed.checkpoint.async_save) of a small model in one
process; the phase hook (hpcml.train.checkpoint.phase.hook) runs in the thread of each phase,
so it sees the writer thread's own nice value.
"""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch

from hpcml.distributed.runtime import Runtime
from hpcml.models.zoo import build_model
from hpcml.train.checkpoint import phase as ckpt_phase
from hpcml.train.checkpoint import store as ckpt
from hpcml.train.checkpoint import writer

RT = Runtime(
    rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"), backend=None
)


@pytest.fixture
def model_opt():
    torch.manual_seed(0)
    model = build_model("mlp", {"hidden": 16, "input_shape": [8]})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    return model, opt


@pytest.fixture
def hook():
    """Installs a phase hook for the test and removes it after (background saves drained)."""
    before = ckpt_phase.hook
    yield lambda fn: setattr(ckpt_phase, "hook", fn)
    try:
        ckpt.wait_pending()
    finally:
        ckpt_phase.hook = before


def _save(root, step, model_opt, nice=0):
    model, opt = model_opt
    return ckpt.save(
        root,
        step,
        model,
        opt,
        {"scheduler": {}},
        {"rng": ckpt.rng_state()},
        RT,
        3,
        background=True,
        writer_nice=nice,
    )


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="threads have nice values on Linux"
)
def test_background_writer_thread_runs_below_training_and_training_keeps_its_priority(
    tmp_path, model_opt, hook
):
    main = writer.this_thread_nice()
    assert main is not None
    if main > 19 - 7:
        pytest.skip(f"this process already runs at nice {main}: no room to lower a thread by 7")
    seen: dict[int, tuple[int | None, int]] = {}

    def record(name: str, step: int) -> None:
        if name == "hash":  # a background save hashes in its writer thread
            seen[step] = (writer.this_thread_nice(), threading.get_native_id())

    hook(record)
    _save(tmp_path, 1, model_opt, nice=0)
    ckpt.wait_pending()
    _save(tmp_path, 2, model_opt, nice=7)
    ckpt.wait_pending()
    assert seen[1][0] == main  # nice 0: the writer at training's priority
    assert seen[2][0] == main + 7 and seen[2][1] != threading.get_native_id()
    assert writer.this_thread_nice() == main  # the loop's thread is never lowered
    assert [p.name for p in ckpt.list_complete(tmp_path)] == ["step-2", "step-1"]


def test_stall_counts_the_wait_for_the_previous_background_save(
    tmp_path, model_opt, hook, monkeypatch
):
    """Save 2 must wait for save 1, whose writer holds its hash phase 1 s from the moment
    save 2 starts waiting. Save 2's stall contains that wait (before, it began after it: a
    tiny model's copy alone, unless its work after the wait took longer than the wait)."""
    waiting = threading.Event()
    waited: list[float] = []
    held_s = 1.0  # a sleep, not CPU
    original = ckpt.wait_pending

    def wait_pending():
        if ckpt._pending is None:
            return original()
        start = time.perf_counter()
        waiting.set()
        try:
            return original()
        finally:
            waited.append(time.perf_counter() - start)

    def hold(name: str, step: int) -> None:
        if name == "hash" and step == 1:
            assert waiting.wait(timeout=60), "save 2 never waited for save 1"
            time.sleep(held_s)

    monkeypatch.setattr(ckpt, "wait_pending", wait_pending)
    hook(hold)
    _save(tmp_path, 1, model_opt)
    _save(tmp_path, 2, model_opt)
    original()
    stall = {t.step: t for t in ckpt.timings[-2:]}
    assert len(waited) == 1 and waited[0] >= held_s
    assert stall[2].stall_s >= waited[0]  # the wait is inside the stall
    assert [p.name for p in ckpt.list_complete(tmp_path)] == ["step-2", "step-1"]
