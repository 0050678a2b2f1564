"""Backends on their own: a child-process instance, torch.compile, CUDA."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from hpcml.errors import ModelError
from hpcml.models.export import save_export
from hpcml.models.zoo import build_model
from hpcml.serve.runtime.backends import ProcessBackend, TorchBackend

ARGS = {"hidden": 32, "depth": 1}


def _export(path: Path) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    model = build_model("mlp", ARGS).eval()
    return save_export(path, model, "mlp", ARGS, (3, 32, 32), (10,)), model


def _expected(model: torch.nn.Module, x: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        return model(torch.from_numpy(x)).numpy()


def test_process_backend_answers_survives_bad_batches_and_reports_a_dead_child(
    tmp_path: Path,
) -> None:
    export, model = _export(tmp_path / "export")
    backend = ProcessBackend("torch", export, threads=1, device="cpu")
    assert backend.input.shape == (3, 32, 32) and backend.platform == "pytorch_torch"
    backend.load()
    try:
        x = np.random.default_rng(0).standard_normal((3, 3, 32, 32)).astype(np.float32)
        # fp32 sums in another order: 2 x Higham-Mary 6 sqrt(K) u |x||W| < 3e-3; answers differ > .1
        np.testing.assert_allclose(backend.infer(x), _expected(model, x), rtol=0, atol=3e-3)
        with pytest.raises(RuntimeError, match="RuntimeError"):
            backend.infer(np.zeros((2, 5), dtype=np.float32))  # wrong shape: fails in torch
        # fp32 sums in another order: 2 x Higham-Mary 6 sqrt(K) u |x||W| < 3e-3; answers differ > .1
        np.testing.assert_allclose(backend.infer(x), _expected(model, x), rtol=0, atol=3e-3)
        backend._proc.kill()
        backend._proc.join(10)
        with pytest.raises(RuntimeError, match="inference process died"):
            backend.infer(x)
    finally:
        backend.close()


def test_process_backend_driven_from_an_event_loop(tmp_path: Path) -> None:
    export, model = _export(tmp_path / "export")
    backend = ProcessBackend("torch", export, threads=1, device="cpu")
    backend.load()
    x = np.random.default_rng(1).standard_normal((40, 3, 32, 32)).astype(np.float32)

    async def main() -> tuple[np.ndarray, str]:
        await backend.infer_async(x[:1])  # the answer pipe is now read by this loop
        abandoned = asyncio.create_task(backend.infer_async(-x))
        await asyncio.sleep(0)  # sent; now the caller gives up before the answer is back
        abandoned.cancel()
        out = await backend.infer_async(x)  # 480 kB in: more than a pipe buffer
        backend._proc.kill()
        try:
            await backend.infer_async(x)
        except RuntimeError as exc:
            return out, str(exc)
        return out, ""

    try:
        out, error = asyncio.run(main())
    finally:
        backend.close()
    # fp32 sums in another order: 2 x Higham-Mary 6 sqrt(K) u |x||W| < 3e-3; answers differ > .1
    np.testing.assert_allclose(out, _expected(model, x), rtol=0, atol=3e-3)
    assert "inference process died" in error


def test_process_backend_load_errors_are_model_errors(tmp_path: Path) -> None:
    export, _ = _export(tmp_path / "export")
    (export / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ModelError, match="cannot be loaded"):
        ProcessBackend("torch", export, device="cpu").load()


@pytest.mark.slow
def test_torch_compile_backend_matches_eager(tmp_path: Path) -> None:
    export, model = _export(tmp_path / "export")
    backend = TorchBackend(export, compile=True, device="cpu")
    backend.load()
    for batch in (1, 5):
        x = np.random.default_rng(batch).standard_normal((batch, 3, 32, 32)).astype(np.float32)
        # fp32 sums in another order: 2 x Higham-Mary 6 sqrt(K) u |x||W| < 3e-3; answers differ > .1
        np.testing.assert_allclose(backend.infer(x), _expected(model, x), rtol=0, atol=3e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_torch_backend_on_cuda_matches_cpu(tmp_path: Path) -> None:
    export, model = _export(tmp_path / "export")
    for backend in (
        TorchBackend(export, device="cuda"),
        ProcessBackend("torch", export, device="cuda"),
    ):
        backend.load()
        x = np.random.default_rng(0).standard_normal((8, 3, 32, 32)).astype(np.float32)
        # fp32 sums in another order: 2 x Higham-Mary 6 sqrt(K) u |x||W| < 3e-3; answers differ > .1 (no TF32 by default)
        np.testing.assert_allclose(backend.infer(x), _expected(model, x), rtol=0, atol=3e-3)
        backend.close()
