"""A checkpoint's own state files (`trainer.pt`, `rank-R.pt`): written plain or sealed
(`encryption`, hpcml.crypt), read without running code from them."""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hpcml import crypt
from hpcml.errors import CheckpointError


def save_state_file(state: dict[str, Any], path: Path, key: crypt.Key | None = None) -> None:
    """torch.save of `state` to `path`, sealed with `key` when one is given."""
    if key is None:
        torch.save(state, path)
        return
    buf = io.BytesIO()
    torch.save(state, buf)
    crypt.write_sealed(path, buf.getvalue(), key)


def load_state_file(path: Path, key: crypt.Key | None = None) -> dict[str, Any]:
    """A trainer or per-rank state file, read without running code from it; a sealed one is
    decrypted with `key` (or the environment's) first.

    `weights_only=True` unpickles tensors and plain containers only; numpy's RNG state is a
    uint32 array, the one foreign type these files hold, so its three globals are allowed.
    A file that names anything else (a crafted pickle) is refused in one sentence.
    """
    data = crypt.read_maybe_sealed(path, key, "checkpoint file")
    core = getattr(np, "_core", None) or np.core
    allowed = [core.multiarray._reconstruct, np.ndarray, np.dtype, np.dtypes.UInt32DType]
    try:
        with torch.serialization.safe_globals(allowed):
            state = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{path} holds objects other than tensors and plain data "
            f"({str(exc).split('Unsupported global: ')[-1].splitlines()[0][:120]}), which hpcml "
            "does not unpickle; resume from a checkpoint hpcml wrote."
        ) from None
    if not isinstance(state, dict):
        raise CheckpointError(
            f"{path} does not hold a state mapping; resume from another checkpoint."
        )
    return state
