"""GPU paths of fault tolerance: background checkpoints staged from device memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fault_util import config_dict, run_engine, summary

from hpcml.train import checkpoint as ckpt

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_async_checkpoints_from_gpu_memory_are_complete_and_resume(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train = {"device": "cuda", "max_steps": 20, "checkpoint_every": 5, "checkpoint_async": True}
    assert run_engine(config_dict(train=train), run) == ("ok", "finished")
    saved = summary(run)["fault"]["checkpoints"]
    assert saved["count"] == 4 and saved["background"] is True
    latest = ckpt.find_latest(run / "checkpoints")
    assert latest is not None and latest.name == "step-20" and ckpt.verify(latest) is None

    more = {**train, "max_steps": 30}
    assert run_engine(config_dict(train=more), run, resume="auto") == ("ok", "finished")
    assert summary(run)["resumed_from"] == str(latest) and summary(run)["steps"] == 30
