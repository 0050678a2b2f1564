"""No code runs from files a user is handed: model.json import paths, checkpoints, CIFAR pickles.

Each hostile file names `os.system` with a command that would create a marker file; the test
checks the marker is never created, the exit code is 2 and stderr is one sentence without a
traceback. `--trust-code` lets a (benign) import path in model.json run, so the refusal is a
gate and not a removed feature.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tests.conftest import hpcml_proc

from hpcml.errors import DataError, ModelError
from hpcml.models.export import load_export, save_export
from hpcml.models.zoo import build_model

pytestmark = pytest.mark.timeout(300)

SRC = Path(__file__).resolve().parents[2] / "src"
ARGS = {"hidden": 16, "depth": 1}


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", **extra}
    env.pop("RANK", None)
    return env


def hpcml(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return hpcml_proc(list(args), cwd, _env(**env), timeout=240)  # forked (tests/conftest.py)


def assert_refused(proc: subprocess.CompletedProcess[str], marker: Path, *words: str) -> None:
    assert not marker.exists(), "the hostile file ran its command"
    assert proc.returncode == 2, proc.stderr[-2000:]
    message = proc.stderr.strip()
    assert "Traceback" not in message
    assert message.startswith("error:") and len(message.splitlines()) == 1, message
    for word in words:
        assert word in message, message


def hostile_export(export: Path, marker: Path) -> Path:
    """A real export whose model.json names os:system with a shell command as its argument."""
    torch.manual_seed(0)
    save_export(export, build_model("mlp", ARGS), "mlp", ARGS, (3, 32, 32), (10,))
    meta = json.loads((export / "model.json").read_text())
    meta["architecture"] = "os:system"
    meta["args"] = {"command": f"touch {marker}"}
    (export / "model.json").write_text(json.dumps(meta))
    return export


class _RunsCommand:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def test_serve_and_onnx_export_refuse_an_import_path_in_model_json(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    export = hostile_export(tmp_path / "export", marker)
    served = hpcml("serve", str(export), "--port", "0", cwd=tmp_path)
    assert_refused(served, marker, "os:system", "--trust-code", "model.json")
    onnx = hpcml("export", "onnx", str(export), cwd=tmp_path)
    assert_refused(onnx, marker, "os:system", "--trust-code")
    # The library path refuses the same way (and so does the thread backend, before loading).
    with pytest.raises(ModelError, match="--trust-code"):
        load_export(export)
    assert not marker.exists()


def test_trust_code_lets_a_users_own_builder_run(tmp_path: Path, monkeypatch: Any) -> None:
    pkg = tmp_path / "userpkg"
    pkg.mkdir()
    (pkg / "my_models.py").write_text(
        "import torch\n"
        "def build(width=4):\n"
        "    torch.manual_seed(0)\n"
        "    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, width))\n"
    )
    monkeypatch.syspath_prepend(str(pkg))
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 4))
    export = save_export(tmp_path / "export", model, "my_models:build", {"width": 4}, (3, 4), (4,))
    with pytest.raises(ModelError, match="import path"):
        load_export(export)
    loaded, _ = load_export(export, trust_code=True)
    x = torch.randn(2, 3, 4)
    torch.testing.assert_close(loaded(x), model(x))


def test_unknown_or_malformed_architecture_is_refused(tmp_path: Path) -> None:
    torch.manual_seed(0)
    export = save_export(tmp_path / "e", build_model("mlp", ARGS), "mlp", ARGS, (3, 32, 32), (10,))
    meta = json.loads((export / "model.json").read_text())
    for arch, words in ((["os", "system"], "names no architecture"), ("nope", "not in the zoo")):
        (export / "model.json").write_text(json.dumps({**meta, "architecture": arch}))
        with pytest.raises(ModelError, match=words):
            load_export(export)


def test_models_uri_with_an_import_path_is_refused_too(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from tests.integration.mlflow_util import fresh_store
    from tests.integration.test_track_registry import make_run

    from hpcml.track.registry import register_run

    store = fresh_store(tmp_path_factory, "trust")
    marker = tmp_path / "pwned"
    run = tmp_path / "run"
    make_run(run, 0.9, 0.3)
    hostile_export(run / "export", marker)
    register_run(run, "hostile", tracking_uri=store, alias="production")
    proc = hpcml(
        "serve",
        "models:/hostile@production",
        "--port",
        "0",
        cwd=tmp_path,
        MLFLOW_TRACKING_URI=store,
    )
    assert_refused(proc, marker, "os:system", "--trust-code")


@pytest.mark.parametrize(
    "target,words",
    [
        ("trainer.pt", ("trainer.pt", "does not unpickle")),
        # DCP's own reader would pickle.load this file (hpcml.distributed.dcp_safe).
        (".metadata", (".metadata", "system", "not unpickled")),
    ],
)
def test_resume_refuses_a_checkpoint_file_that_names_code(
    tmp_path: Path, target: str, words: tuple[str, ...]
) -> None:
    run = tmp_path / "run"
    args = [
        "train",
        str(SRC.parent / "examples" / "digits_cnn.yaml"),
        "--run-dir",
        str(run),
        "--quiet",
        "model.name=mlp",
        "model.args={hidden: 8, depth: 1}",
        "train.max_steps=2",
        "train.checkpoint_every=2",
        "train.eval_every=0",
        "data.batch_size=16",
        "optim.decay_steps=4",
    ]
    first = hpcml(*args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    ckpt = run / "checkpoints" / "step-2"
    marker = tmp_path / "pwned"
    hostile = ckpt / target
    if target == "trainer.pt":
        torch.save({"step": 2, "world_size": 1, "evil": _RunsCommand(marker)}, hostile)
    else:
        hostile.write_bytes(pickle.dumps(_RunsCommand(marker)))
    # Keep the manifest consistent, so the refusal comes from the loader, not the sha256 check.
    import hashlib

    manifest = json.loads((ckpt / "manifest.json").read_text())
    entry = manifest["files"][target]
    entry["sha256"] = hashlib.sha256(hostile.read_bytes()).hexdigest()
    entry["bytes"] = hostile.stat().st_size
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    resumed = hpcml(*args, "--resume", str(ckpt), "train.max_steps=4", cwd=tmp_path)
    assert_refused(resumed, marker, *words)
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_cifar_batches_unpickle_arrays_only(tmp_path: Path) -> None:
    from hpcml.data.sources import _read_cifar_batch

    rng = np.random.default_rng(0)
    good = {
        b"batch_label": b"training batch 1 of 5",
        b"labels": [3, 7],
        b"data": rng.integers(0, 256, (2, 3072), dtype=np.uint8),
        b"filenames": [b"a.png", b"b.png"],
    }
    (tmp_path / "good").write_bytes(pickle.dumps(good, protocol=2))
    data, labels = _read_cifar_batch(tmp_path / "good")
    assert data.shape == (2, 3, 32, 32) and labels.tolist() == [3, 7]
    np.testing.assert_array_equal(data.reshape(2, -1), good[b"data"])

    marker = tmp_path / "pwned"
    folder = tmp_path / "cifar"
    folder.mkdir()
    (folder / "data_batch_1").write_bytes(pickle.dumps({b"data": _RunsCommand(marker)}))
    with pytest.raises(DataError, match="system"):
        _read_cifar_batch(folder / "data_batch_1")
    assert not marker.exists()
    proc = hpcml(
        "train",
        str(SRC.parent / "examples" / "digits_cnn.yaml"),
        "--run-dir",
        str(tmp_path / "r"),
        "--quiet",
        "data.source=cifar10",
        f"data.path={folder}",
        "train.max_steps=1",
        cwd=tmp_path,
    )
    assert_refused(proc, marker, "data_batch_1")
