"""`make gpu` rehearsed without a GPU: benchmarks/gpu_proof.py runs every stage on the CPU at toy
sizes, in a Python that sees only what the GPU image has (benchmarks/gpu_image_packages.txt) and
the wheels `make gpu-wheels` carries (benchmarks/gpu_wheels.txt), so that a stage broken by a
change, or a dependency the image lacks, is found here and not in a 15-minute GPU lease."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
STAGES = ["env", "pytest", "gpt", "cnn", "memory", "serving", "llm", "checkpoint"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dry_report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("gpu-dry")
    cmd = [
        sys.executable,
        str(BENCH / "gpu_proof.py"),
        "--dry",
        "--out",
        str(out),
        "--image-packages",
        str(BENCH / "gpu_image_packages.txt"),
        "--budget-s",
        "900",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "gpu_proof.json").read_text())
    report["_md"] = (out / "gpu_proof.md").read_text()
    return report


def test_every_stage_runs_to_its_end_in_the_rehearsal(dry_report: dict) -> None:
    stages = dry_report["stages"]
    assert dry_report["dry"] is True and list(stages) == STAGES
    failed = {k: v for k, v in stages.items() if v["status"] != "ok"}
    assert not failed, failed
    # Nothing the stages import is missing on the image (plus the wheels).
    assert stages["env"]["missing_modules"] == {}
    # Every test file that carries the gpu marker was collected (imports included).
    assert stages["pytest"]["rc"] == 0
    assert "tests/integration/test_sharded_gpu.py" in stages["pytest"]["files"]
    # The stages measured something on their way (toy sizes: no values asserted).
    assert stages["cnn"]["hpcml"]["fp32_eager"]["samples_per_s"] > 0
    assert stages["llm"]["equal_itl"][0]["continuous"] is not None
    assert set(stages["memory"]["runs"]) >= {"gpt-eager", "gpt-recompute"}
    assert stages["checkpoint"]["modes"]["async_nice0"]["checkpoints_per_run"] == 2
    for stage in STAGES[1:]:  # the markdown has a row for every stage's result
        assert f"| {stage} | ok |" in dry_report["_md"]


def test_the_image_python_lacks_what_the_image_lacks(tmp_path: Path) -> None:
    """The rehearsal can fail: a distribution neither on the image nor carried (mlflow, which
    this machine has) is absent from its Python, one the image has (numpy) is there."""
    sys.path.insert(0, str(BENCH))
    try:
        from gpu_image import image_python
    finally:
        sys.path.remove(str(BENCH))
    python = image_python(BENCH / "gpu_image_packages.txt", BENCH / "gpu_wheels.txt")
    probe = (
        "import importlib.util as u; print(u.find_spec('mlflow'), u.find_spec('numpy') is not None)"
    )
    out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["None", "True"], out
