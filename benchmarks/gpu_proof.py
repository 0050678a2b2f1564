"""`make gpu`: every GPU claim of hpcml proved in one prepared command that fits a short lease.

A GPU lease here is ~15 minutes on one H100 or H200 that starts bare (its own Python with
torch + CUDA, no internet). This script runs stages in order, each in its own process under
`timeout` with a budget of its own and an overall deadline (`--budget-s`, default 480 s), and
after every stage rewrites gpu_proof.json and gpu_proof.md in `--out` with what it has, so a
stage that hangs or fails costs its budget and nothing else:

  env      device, driver, versions, and which packages the other stages need are missing
  pytest   `pytest -m gpu` over the test files that carry the gpu marker (junit.xml)
  gpt      gpt2-small MFU, tokens/s eager vs compiled, host syncs per steady-state step
  cnn      SimpleCNN samples/s: fp32 vs bf16 + channels_last + compile, hpcml vs a hand loop
  memory   the planner's peak vs torch.cuda.max_memory_allocated, 3+ layouts
  llm      continuous vs static batching at equal p99 ITL, long-tailed outputs
  serving  `hpcml serve` capacity at p99 <= 50 ms vs the raw batched forward

    make gpu-wheels                       # here: fills .whl/ with what the GPU image lacks
    make gpu                              # there (or here: the dry rehearsal)
    python benchmarks/gpu_proof.py --out DIR [--only gpt,cnn] [--budget-s 480] [--dry]

Without a CUDA device it runs in dry mode: the same stages on the CPU at toy sizes, up to the
point where a device is needed, each skip said in one line (tests/integration/
test_gpu_proof.py runs it, so this script cannot rot); a dry stage but `env` is forked from
the process that imported torch and hpcml once, where on the GPU each is a new interpreter.
With `--image-packages FILE` the stages run in a Python where every distribution that is
neither in FILE (nor required by one), nor in the wheels `make gpu-wheels` carries, is
absent, as it is on the GPU image (benchmarks/gpu_image.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
RESULTS = BENCH / "results" / "gpu"
sys.path.insert(0, str(BENCH))

from gpu_report import markdown  # noqa: E402  (benchmarks/ is not a package)

# (stage, budget in seconds): the order they run in; a stage gets min(budget, time left).
PLAN = [
    ("env", 40),
    ("pytest", 170),
    ("gpt", 150),
    ("cnn", 120),
    ("memory", 90),
    ("serving", 90),
    ("llm", 150),
    ("checkpoint", 90),  # issue 40: alone, `bash benchmarks/gpu_run.sh --only checkpoint`
]
MIN_STAGE_S = 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="default: results/gpu; dry: a temporary folder")
    ap.add_argument("--only", default="", help="comma-separated stages (default: all)")
    ap.add_argument("--budget-s", type=float, default=480.0)
    ap.add_argument("--dry", action="store_true", help="rehearse on the CPU even with a GPU")
    ap.add_argument("--image-packages", type=Path, help="dry: allow only these distributions")
    ap.add_argument("--stage", help=argparse.SUPPRESS)  # internal: run one stage here
    ap.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--in-image", action="store_true", help=argparse.SUPPRESS)  # internal
    args = ap.parse_args()
    if args.stage:
        return run_stage(args.stage, args.work, args.out, args.dry)
    if args.dry and args.image_packages and not args.in_image:
        raise SystemExit(in_image_python(args.image_packages))
    import torch

    dry = args.dry or not torch.cuda.is_available()
    if args.out is None:  # a rehearsal never overwrites the GPU's results
        args.out = Path(tempfile.mkdtemp(prefix="hpcml-gpu-dry-")) if dry else RESULTS
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.out / "work" if dry else Path("/tmp/hpcml-gpu-proof")
    work.mkdir(parents=True, exist_ok=True)
    args.python = sys.executable
    if args.image_packages and not args.in_image:  # the stages see only what the image has
        from gpu_image import image_python

        args.python = image_python(args.image_packages, BENCH / "gpu_wheels.txt")
    wanted = [s for s in args.only.split(",") if s] or [name for name, _ in PLAN]
    unknown = set(wanted) - {name for name, _ in PLAN}
    if unknown:
        raise SystemExit(
            f"--only: unknown stage(s) {sorted(unknown)}; stages: {[n for n, _ in PLAN]}"
        )
    report: dict[str, Any] = {
        "benchmark": "gpu_proof",
        "dry": dry,
        "commit": os.environ.get("HPCML_COMMIT") or _git_commit(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(["python", "benchmarks/gpu_proof.py", *sys.argv[1:]]),
        "budget_s": args.budget_s,
        "stages": {},
    }
    deadline = time.monotonic() + args.budget_s
    log = (args.out / "gpu_proof.log").open("a")
    for name, budget in PLAN:
        if name not in wanted:
            continue
        left = deadline - time.monotonic()
        if left < MIN_STAGE_S:
            report["stages"][name] = {"status": "not run", "reason": f"{left:.0f} s left"}
        else:
            # Dry: `env` in a new interpreter, as every stage on the GPU (the path and the
            # probe of what the image lacks rehearsed as they run there), the rest forked.
            run = run_forked if dry and name != "env" else run_isolated
            report["stages"][name] = run(name, min(budget, left), work, args, dry, log)
        _write(report, args.out)
    log.close()
    report["wall_s"] = args.budget_s - (deadline - time.monotonic())
    _write(report, args.out)
    print(markdown(report), flush=True)


def run_isolated(
    name: str, budget: float, work: Path, args: argparse.Namespace, dry: bool, log: Any
) -> dict[str, Any]:
    """One stage in a child process under `timeout` (SIGTERM, then SIGKILL 10 s later)."""
    result = work / f"{name}.json"
    result.unlink(missing_ok=True)
    cmd = [
        "timeout",
        "-k",
        "10",
        f"{budget:.0f}",
        str(args.python),
        __file__,
        "--stage",
        name,
        "--work",
        str(work),
        "--out",
        str(args.out),
    ] + (["--dry"] if dry else [])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(BENCH), env.get("PYTHONPATH", "")])
    banner = f"== stage {name} (budget {budget:.0f} s{', dry' if dry else ''})"
    print(banner, flush=True)
    log.write(banner + "\n")
    log.flush()
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    tail: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        log.write(line)
        tail = (tail + [line.rstrip()])[-15:]
    rc = proc.wait()
    log.flush()
    seconds = time.monotonic() - t0
    if rc == 0 and result.exists():
        return {"status": "ok", "seconds": seconds, **json.loads(result.read_text())}
    status = "timeout" if rc in (124, 137) else "failed"
    return {"status": status, "rc": rc, "seconds": seconds, "tail": tail}


def in_image_python(packages: Path) -> int:
    """The dry rehearsal with --image-packages: this script again, in the Python that sees only
    what the GPU image has, where it imports torch once and forks every stage from itself."""
    from gpu_image import image_python

    python = image_python(packages, BENCH / "gpu_wheels.txt")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(BENCH), env.get("PYTHONPATH", "")])
    cmd = [str(python), __file__, *sys.argv[1:], "--in-image"]
    return subprocess.run(cmd, cwd=ROOT, env=env, check=False).returncode


def run_forked(
    name: str, budget: float, work: Path, args: argparse.Namespace, dry: bool, log: Any
) -> dict[str, Any]:
    """A dry stage in a child forked from this process, which imported torch and hpcml once
    (each stage in a new interpreter spent ~18 of its ~20 s on a loaded 2-core machine
    importing them again): a stage that fails or hangs still costs only its own budget
    (SIGTERM at the budget, SIGKILL 10 s later, as `timeout -k 10` does)."""
    import multiprocessing as mp
    import signal

    import hpcml.train.entry  # noqa: F401  (imported once, before the forks)

    result, output = work / f"{name}.json", work / f"{name}.log"
    result.unlink(missing_ok=True)
    banner = f"== stage {name} (budget {budget:.0f} s, dry, forked)"
    print(banner, flush=True)
    log.write(banner + "\n")
    t0 = time.monotonic()
    proc = mp.get_context("fork").Process(target=_forked_stage, args=(name, work, args, output))
    proc.start()
    proc.join(budget)
    timed_out = proc.exitcode is None
    if timed_out:
        os.kill(proc.pid, signal.SIGTERM)
        proc.join(10)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
    text = output.read_text(errors="replace") if output.exists() else ""
    sys.stdout.write(text)
    log.write(text)
    log.flush()
    seconds = time.monotonic() - t0
    if proc.exitcode == 0 and result.exists():
        return {"status": "ok", "seconds": seconds, **json.loads(result.read_text())}
    tail = text.splitlines()[-15:]
    return {"status": "timeout" if timed_out else "failed", "rc": proc.exitcode,
            "seconds": seconds, "tail": tail}  # fmt: skip


def _forked_stage(name: str, work: Path, args: argparse.Namespace, output: Path) -> None:
    """In the forked child: its stdout and stderr to `output`, then the stage."""
    with output.open("w") as fh:
        os.dup2(fh.fileno(), 1)
        os.dup2(fh.fileno(), 2)
    run_stage(name, work, args.out, True)
    sys.stdout.flush()


def run_stage(name: str, work: Path, out: Path, dry: bool) -> None:
    import torch

    dev = torch.device("cpu" if dry else "cuda")
    if name == "env":
        result = stage_env(dev, dry)
    elif name == "pytest":
        result = stage_pytest(out, dry)
    else:
        from gpu_serve_stages import STAGES as SERVE
        from gpu_train_stages import STAGES as TRAIN

        stage_work = work / name
        stage_work.mkdir(parents=True, exist_ok=True)
        fn = {**TRAIN, **SERVE}[name]
        result = fn(work if name == "memory" else stage_work, dev, dry)
    (work / f"{name}.json").write_text(json.dumps(result, indent=1, default=str))


def stage_env(dev: Any, dry: bool) -> dict[str, Any]:
    import importlib

    import torch

    out: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "host_cpus": os.cpu_count(),
    }
    for mod in ("triton", "transformers", "numpy", "pydantic", "fastapi", "torchdata"):
        try:
            out[mod] = getattr(importlib.import_module(mod), "__version__", "?")
        except ImportError as exc:
            out[mod] = f"missing: {exc}"
    if not dry:
        props = torch.cuda.get_device_properties(dev)
        out["device"] = {
            "name": props.name,
            "memory_bytes": int(props.total_memory),
            "multiprocessors": props.multi_processor_count,
            "capability": f"{props.major}.{props.minor}",
        }
        smi = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        out["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    else:
        print("dry: no CUDA device; device and driver not read", flush=True)
    # Every module a later stage or gpu test imports: a missing one is named here, first.
    needed = [
        "hpcml.cli.app",
        "hpcml.train.trainer",
        "hpcml.serve.protocol.app",
        "hpcml.serve.loadtest",
        "hpcml.serve.generate.engine",
        "transformers",
        "pytest",
        "pytest_timeout",
    ]
    out["missing_modules"] = {}
    for mod in needed:
        try:
            importlib.import_module(mod)
        except Exception as exc:  # noqa: BLE001  (any import failure is what we report)
            out["missing_modules"][mod] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(out, indent=1), flush=True)
    return out


def gpu_test_files() -> list[str]:
    return sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("test_*.py")
        if "pytest.mark.gpu" in p.read_text()
    )


def stage_pytest(out: Path, dry: bool) -> dict[str, Any]:
    files = gpu_test_files()
    junit = out / "junit.xml"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "gpu",
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
        "--timeout",
        "150",
        f"--junitxml={junit}",
        *files,
    ]
    print("$ " + " ".join(cmd[1:]), flush=True)
    if dry:  # collected in this (forked) process, which imported torch already
        import pytest

        print("dry: gpu tests collected, not run (no CUDA device)", flush=True)
        return {"files": files, "rc": int(pytest.main([*cmd[3:], "--collect-only"]))}
    proc = subprocess.run(cmd, cwd=ROOT, check=False)
    counts = _junit_counts(junit) if junit.exists() else {}
    return {"files": files, "rc": proc.returncode, **counts}


def _junit_counts(path: Path) -> dict[str, Any]:
    import xml.etree.ElementTree as ET

    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    failed = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")} | {
        "failed": failed
    }


def _git_commit() -> str | None:
    proc = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    return proc.stdout.strip() or None


def _write(report: dict[str, Any], out: Path) -> None:
    (out / "gpu_proof.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "gpu_proof.md").write_text(markdown(report))


if __name__ == "__main__":
    main()
