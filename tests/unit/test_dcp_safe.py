"""A DCP checkpoint folder is read without running code from it (`hpcml.train.dcp_safe`).

Each payload below runs `os.system("touch MARKER")` when unpickled by DCP's own reader or
planner; the test shows that first (so the payload is real), then that the safe pieces refuse
it in one sentence and the marker never appears.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hpcml.distributed import dcp_safe
from hpcml.errors import CheckpointError


class Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def state() -> dict[str, object]:
    torch.manual_seed(0)
    return {
        "model": {"w": torch.randn(4, 3), "b": torch.zeros(3)},
        "optim": {"lr": 0.001, "betas": (0.9, 0.999), "step": 7, "name": "adamw", "x": None},
    }


def safe_load(target: dict[str, object], path: Path) -> None:
    dcp_safe.load(target, path, no_dist=True)


def test_a_checkpoint_of_ours_loads_exactly(tmp_path: Path) -> None:
    saved = state()
    dcp.save(saved, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    target = {
        "model": {"w": torch.empty(4, 3), "b": torch.empty(3)},
        "optim": {"lr": 0.0, "betas": (0.0, 0.0), "step": 0, "name": "", "x": 1},
    }
    safe_load(target, tmp_path / "ck")
    assert torch.equal(target["model"]["w"], saved["model"]["w"])  # type: ignore[index]
    assert target["optim"] == saved["optim"]


def test_crafted_metadata_runs_nothing(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    dcp.save(state(), checkpoint_id=str(ck), no_dist=True)
    marker = tmp_path / "pwned"
    (ck / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(CheckpointError, match=r"names posix\.system|names os\.system"):
        safe_load(state(), ck)
    with pytest.raises(CheckpointError, match="not unpickled"):
        dcp_safe.read_metadata(ck)
    assert not marker.exists()
    # DCP's own reader runs it: the payload is real.
    with pytest.raises(BaseException):  # noqa: B017 - DCP wraps what it makes of an int
        dcp.load(state(), checkpoint_id=str(ck), no_dist=True)
    assert marker.exists()


def test_crafted_bytes_entry_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    ck = tmp_path / "ck"
    evil = state()
    evil["optim"]["lr"] = Payload(marker)  # type: ignore[index]
    dcp.save(evil, checkpoint_id=str(ck), no_dist=True)
    with pytest.raises(CheckpointError, match="optim.lr holds more than plain data"):
        safe_load(state(), ck)
    assert not marker.exists()
    dcp.load(state(), checkpoint_id=str(ck), no_dist=True)  # DCP's planner runs it
    assert marker.exists()
