"""Token data: the pystdlib corpus, windows, and the random-window sampler's determinism."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hpcml.config import DataConfig
from hpcml.data.loader import EpochLoader
from hpcml.data.sources import check_source, load_source
from hpcml.data.sources.tokens import RandomWindowSampler, eval_starts, prepare_pystdlib
from hpcml.errors import DataError

SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pystdlib")
    prepare_pystdlib(out, val_fraction=0.2, max_bytes=400_000)
    return out


def test_prepare_writes_uint16_bytes_and_meta(corpus: Path) -> None:
    meta = json.loads((corpus / "meta.json").read_text())
    train = np.fromfile(corpus / "train.bin", dtype=np.uint16)
    val = np.fromfile(corpus / "val.bin", dtype=np.uint16)
    assert meta["vocab_size"] == 256 and meta["tokenizer"] == "bytes"
    assert meta["tokens"] == {"train": train.size, "val": val.size}
    assert train.max() < 256 and val.size > 0
    assert meta["files"]["train"] > 0 and meta["files"]["val"] > 0
    # Byte tokens decode back to Python source, documents separated by NUL.
    text = train[:2000].astype(np.uint8).tobytes().split(b"\0")[0].decode()
    assert "import" in text or "def " in text or '"""' in text


def test_split_is_stable_across_runs(corpus: Path, tmp_path: Path) -> None:
    meta = prepare_pystdlib(tmp_path, val_fraction=0.2, max_bytes=400_000)
    first = json.loads((corpus / "meta.json").read_text())
    assert meta["sha256"] == first["sha256"]


def test_cli_prepare(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    cmd = [sys.executable, "-m", "hpcml", "data", "prepare", "pystdlib", "--out", str(tmp_path)]
    out = subprocess.run(
        [*cmd, "--max-bytes", "300000", "--val-fraction", "0.3", "--json"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["tokens"]["train"] > 50_000
    bad = subprocess.run(
        [*cmd[:5], "wikipedia", "--out", str(tmp_path)], env=env, capture_output=True, text=True
    )
    assert bad.returncode == 2 and "not known" in bad.stderr


def test_windows_are_next_token_pairs(corpus: Path) -> None:
    cfg = DataConfig(source="tokens", path=str(corpus), seq_len=32, eval_windows=8)
    splits = load_source(cfg)
    assert splits.input_shape == (32,) and splits.num_classes == 256
    assert splits.input_dtype == "int64" and splits.target_shape == (32,)
    x, y = splits.train[100]
    tokens = np.fromfile(corpus / "train.bin", dtype=np.uint16)
    assert x.dtype == torch.int64 and x.tolist() == tokens[100:132].tolist()
    assert y.tolist() == tokens[101:133].tolist()
    assert len(splits.val) == 8


def test_single_file_holds_out_a_tail(corpus: Path) -> None:
    cfg = DataConfig(
        source="tokens",
        path=str(corpus / "train.bin"),
        seq_len=16,
        val_fraction=0.1,
        eval_windows=None,
    )
    splits = load_source(cfg)
    n = (corpus / "train.bin").stat().st_size // 2
    assert splits.train.n_tokens == n - int(n * 0.1)  # type: ignore[attr-defined]
    assert min(splits.val.starts) >= splits.train.n_tokens  # type: ignore[attr-defined]


def test_missing_path_is_a_data_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="hpcml data prepare pystdlib"):
        check_source(DataConfig(source="tokens", path=str(tmp_path / "nope")))
    with pytest.raises(DataError, match="needs data.path"):
        check_source(DataConfig(source="tokens"))


def test_sampler_is_deterministic_and_world_size_consistent() -> None:
    def stream(rank: int, world: int, epoch: int) -> list[int]:
        s = RandomWindowSampler(10_000, 64, rank, world, seed=7)
        s.set_epoch(epoch)
        return list(s)

    assert stream(0, 1, 0) == stream(0, 1, 0)
    assert stream(0, 1, 0) != stream(0, 1, 1)  # a new epoch draws new windows
    one = stream(0, 1, 0)
    r0, r1 = stream(0, 2, 0), stream(1, 2, 0)
    # Two ranks' first B windows are together the single process's first 2B windows.
    assert sorted(r0[:4] + r1[:4]) == sorted(one[:8])
    assert len(r0) == len(r1) == 32


def test_loader_resumes_on_the_next_unseen_batch(corpus: Path) -> None:
    cfg = DataConfig(source="tokens", path=str(corpus), seq_len=16, batch_size=4)
    ds = load_source(cfg).train
    a = EpochLoader(ds, cfg, rank=1, world_size=2, seed=3, pin_memory=False)
    for _ in range(5):
        a.next()
    state = a.state_dict()
    expected = [a.next()[0] for _ in range(3)]
    b = EpochLoader(ds, cfg, rank=1, world_size=2, seed=3, pin_memory=False)
    b.load_state_dict(state)
    got = [b.next()[0] for _ in range(3)]
    assert all(torch.equal(e, g) for e, g in zip(expected, got, strict=True))


def test_eval_starts_even_and_limited() -> None:
    assert eval_starts(100, 10, None).tolist() == list(range(0, 90, 10))
    limited = eval_starts(10_001, 10, 5)
    assert len(limited) == 5 and limited[0] == 0 and limited[-1] == 9990
