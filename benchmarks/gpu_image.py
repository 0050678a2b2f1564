"""A Python environment that sees only what the GPU image has, for the dry rehearsal of
`make gpu` (gpu_proof.py --image-packages): a virtual environment whose site-packages holds
links to this machine's copies of the image's distributions (gpu_image_packages.txt, with
everything they require, since pip installed each with its requirements there) and of the
wheels `make gpu-wheels` carries (gpu_wheels.txt, installed there without dependencies).
Anything else is absent, exactly as there: an import fails, a probe finds nothing. Written by
hand: no library builds a venv from another machine's package list."""

from __future__ import annotations

import importlib.metadata
import re
import sys
import tempfile
import venv
from pathlib import Path


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def names(path: Path) -> set[str]:
    out = set()
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            out.add(_norm(re.split(r"[=<>\[; ]", line, maxsplit=1)[0]))
    return out


def with_requirements(
    image: set[str], by_name: dict[str, importlib.metadata.Distribution]
) -> set[str]:
    seen, todo = set(image), list(image)
    while todo:
        dist = by_name.get(todo.pop())
        for req in (dist.requires or []) if dist else []:
            if "extra ==" in req:
                continue
            name = _norm(re.split(r"[=<>!~\[; (]", req, maxsplit=1)[0])
            if name not in seen:
                seen.add(name)
                todo.append(name)
    return seen


def image_python(packages: Path, wheels: Path) -> Path:
    """The python of a new venv (in a temporary folder) holding only the allowed distributions."""
    by_name = {_norm(d.metadata["Name"]): d for d in importlib.metadata.distributions()}
    allowed = with_requirements(names(packages), by_name) | names(wheels)
    allowed.discard("hpcml")  # the source tree is on PYTHONPATH, as on the GPU machine
    root = Path(tempfile.mkdtemp(prefix="hpcml-gpu-image-"))
    venv.create(root, with_pip=False, symlinks=True)
    v = sys.version_info
    site = root / "lib" / f"python{v.major}.{v.minor}" / "site-packages"
    for name in sorted(allowed & by_name.keys()):
        dist = by_name[name]
        for top in {f.parts[0] for f in dist.files or [] if f.parts and f.parts[0] != ".."}:
            target, link = Path(str(dist.locate_file(top))), site / top
            if target.exists() and not link.exists():
                link.symlink_to(target)
    return root / "bin" / "python"
