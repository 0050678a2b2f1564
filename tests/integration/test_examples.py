"""Every file under examples/ runs as written, through the real `hpcml` command in a subprocess,
so the docs that point at them cannot rot.

`EXAMPLES` says per file how its header runs it and which dotted overrides shorten the run
(steps, data sizes; nothing else unless a comment beside it says why). A file in examples/
without an entry fails `test_example_runs_as_written`. Each run's working folder holds what
the headers say to prepare (`data/pystdlib`, `data/cifar10`, `runs/...`) and an `examples`
link to the repository's own folder, so the examples' relative paths are used as written.
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import yaml
from tests.conftest import ROOT, hpcml_env, hpcml_proc, summary

from hpcml.config import load_config
from hpcml.data.sources import load_source
from hpcml.errors import DataError
from hpcml.serve.protocol.app import bind_socket
from hpcml.serve.runtime.onnx_export import export_onnx

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

EXAMPLES_DIR = ROOT / "examples"
EXAMPLE_FILES = sorted(p.name for p in EXAMPLES_DIR.iterdir() if p.is_file())

# Two steps, no evaluation or checkpoint before the end (both still happen once at the end).
SHORT = ("train.max_steps=2", "train.eval_every=0", "train.checkpoint_every=0")
# Byte-token examples: 64-token windows and a few validation windows (the corpus is tiny).
TOKENS_SHORT = (*SHORT, "data.eval_windows=8")

# What the first header line says, and what the error says when the data is missing.
TOKENS_HOW = "hpcml data prepare pystdlib --out data/pystdlib"
CIFAR_HOW = "unpack cifar-10-python.tar.gz from https://www.cs.toronto.edu/~kriz/cifar.html into"
CIFAR_SAMPLES_PER_BATCH = 8  # each of the 6 fake batches (5 training, 1 test)
CORPUS_MAX_BYTES = 300_000


@dataclass(frozen=True)
class Train:
    """`hpcml train examples/NAME [--nproc N] --run-dir RUN OVERRIDES`, in the working folder."""

    nproc: int
    overrides: tuple[str, ...]
    param_shards: int
    """Into how many pieces each rank's parameters are cut (dp sharding x tp): measured in
    summary.json's per-rank memory, so a strategy that was not applied shows."""
    optimizer_shards: int | None = 1
    """The same for AdamW's state (None: not AdamW)."""
    needs: str | None = None
    """Words of the header's first line that say how to get the data; the error without it
    says them too."""
    torchrun: bool = False
    """Start the workers with torchrun itself (the user's launcher) instead of --nproc."""
    run_dir: str | None = None
    steps: int = 2
    """The steps the run makes (SHORT's, or the file's own when it runs unshortened)."""
    base: str | None = None
    """An example whose run's export this one starts from (model.init_from): trained first."""


@dataclass(frozen=True)
class Serve:
    """`hpcml serve runs/repo --config examples/NAME --port P` on models the header says to make."""

    trains: str
    versions: tuple[str, ...]
    needs: str


@dataclass(frozen=True)
class Tune:
    """`hpcml tune examples/NAME OVERRIDES --workers W --trials T --out RUN --json`."""

    workers: int
    trials: int
    overrides: tuple[str, ...]
    needs: str | None = None


EXAMPLES: dict[str, Train | Serve | Tune] = {
    # Header: --nproc 8 on a GPU node; this machine runs at most 2 processes (one per core),
    # and DDP's layout is the same for any N. data.batch_size: the fake batches are small.
    "cifar10_resnet18.yaml": Train(
        2, (*SHORT, "data.batch_size=4"), 1, optimizer_shards=None, needs=CIFAR_HOW
    ),
    # Header: "with --nproc 2". Not shortened: this is the demo (`make demo`), whose accuracy
    # test_the_demo_reaches_97_percent_and_the_pages_show_its_numbers checks on this very run
    # (150 steps, about a minute on 2 cores). serve_digits.yaml's header trains it into
    # runs/digits-int8.
    "digits_cnn.yaml": Train(2, (), 1, run_dir="runs/digits-int8", steps=150),
    # Header: --nproc 8 as dp 4 x tp 2. Here dp 2 x tp 2 keeps the 2-D mesh: 4 processes, which
    # `hpcml train --nproc 4` refuses on 2 cores (one process per core), so torchrun starts
    # `hpcml train` itself, as on a cluster. Overridden because the real run cannot happen on
    # CPU: model.args (gpt-1.3b is 21 GB of fp32 states and minutes per step on 2 cores; still
    # 16 heads, 2 blocks so selective checkpointing of every 2nd block applies), data.seq_len
    # and data.batch_size (to match), and train.compile (inductor runs on CPU but took 83 s of
    # compiling against 16 s without it). bf16, FSDP x TP and sequence parallelism run as written.
    # Header: gpt_tiny_ddp.yaml's run is the base (model.init_from). AdamW's state is the
    # adapters' only (optimizer_shards None: not 1/1 of the parameters).
    "finetune_lora.yaml": Train(
        1, TOKENS_SHORT, 1, optimizer_shards=None, needs=TOKENS_HOW, base="gpt_tiny_ddp.yaml"
    ),
    "gpt_1p3b_fsdp_tp.yaml": Train(
        4,
        (
            *TOKENS_SHORT,
            "model.args={n_layer: 2, d_model: 64}",
            "data.seq_len=64",
            "data.batch_size=2",
            "train.compile=false",
        ),
        4,
        4,
        needs=TOKENS_HOW,
        torchrun=True,
    ),
    # Header: one process. The 85M-parameter model runs as written in bf16; only the windows
    # shrink. train.compile=false: inductor runs on CPU, but its compile took 22 of 37 s.
    "gpt_small.yaml": Train(
        1,
        (*TOKENS_SHORT, "data.seq_len=64", "data.batch_size=1", "train.compile=false"),
        1,
        needs=TOKENS_HOW,
    ),
    "gpt_tiny_ddp.yaml": Train(2, TOKENS_SHORT, 1, 1, needs=TOKENS_HOW),
    # Each of the 2 stages holds half of the blocks (and the embedding or the head) and its AdamW state.
    "gpt_tiny_pp.yaml": Train(2, TOKENS_SHORT, 2, 2, needs=TOKENS_HOW),
    "gpt_tiny_tp.yaml": Train(2, TOKENS_SHORT, 2, 2, needs=TOKENS_HOW),
    "gpt_tiny_zero1.yaml": Train(2, TOKENS_SHORT, 1, 2, needs=TOKENS_HOW),
    "gpt_tiny_zero2.yaml": Train(2, TOKENS_SHORT, 2, 2, needs=TOKENS_HOW),
    "gpt_tiny_zero3.yaml": Train(2, TOKENS_SHORT, 2, 2, needs=TOKENS_HOW),
    "serve_digits.yaml": Serve(
        "digits_cnn.yaml", ("1", "2", "3"), needs="hpcml train examples/digits_cnn.yaml"
    ),
    # Header: --workers 2 (8 trials of 60 steps); here 2 trials of 4 steps, evaluated every 2.
    "tune_digits.yaml": Tune(2, 2, ("train.max_steps=4", "train.eval_every=2")),
    # Header names no command: one process. Fewer random samples and a smaller batch.
    "synthetic_cnn.yaml": Train(1, (*SHORT, "data.synthetic_samples=64", "data.batch_size=16"), 1),
}


def _cifar_folder(root: Path) -> None:
    """The official python format: pickled dicts of uint8 rows (3072 = 3x32x32) and labels."""
    rng = np.random.default_rng(0)
    root.mkdir(parents=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {
            b"data": rng.integers(0, 256, size=(CIFAR_SAMPLES_PER_BATCH, 3072), dtype=np.uint8),
            b"labels": [int(v) for v in rng.integers(0, 10, size=CIFAR_SAMPLES_PER_BATCH)],
        }
        (root / name).write_bytes(pickle.dumps(batch, protocol=2))


def _folder_with_examples(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "examples").symlink_to(EXAMPLES_DIR, target_is_directory=True)
    return path


def _fail_text(proc: subprocess.CompletedProcess[str], what: str) -> str:
    return (
        f"{what} exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\n"
        f"stderr:\n{proc.stderr[-3000:]}"
    )


def _hpcml(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return hpcml_proc(args, cwd, timeout=timeout)  # forked (tests/conftest.py)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The working folder: examples/, the token corpus made by the headers' own command, and a
    CIFAR-10 folder in the official format."""
    root = _folder_with_examples(tmp_path_factory.mktemp("examples-work"))
    proc = _hpcml(
        [
            "data",
            "prepare",
            "pystdlib",
            "--out",
            "data/pystdlib",
            "--val-fraction",
            "0.2",
            "--max-bytes",
            str(CORPUS_MAX_BYTES),
        ],
        root,
    )
    assert proc.returncode == 0, _fail_text(proc, "hpcml data prepare")
    _cifar_folder(root / "data" / "cifar10")
    return root


Trained = tuple[subprocess.CompletedProcess[str], Path]


@pytest.fixture(scope="module")
def trained(work: Path) -> Callable[[str], Trained]:
    """Runs a training example once (the serve example reuses the digits run)."""
    done: dict[str, Trained] = {}

    def run(name: str) -> Trained:
        if name not in done:
            entry = EXAMPLES[name]
            assert isinstance(entry, Train)
            if entry.base is not None:
                run(entry.base)
            run_dir = work / (entry.run_dir or f"runs/{Path(name).stem}")
            args = ["train", f"examples/{name}", *entry.overrides, "--run-dir", str(run_dir)]
            if entry.torchrun:
                launcher = ["-m", "torch.distributed.run", "--standalone"]
                cmd = [*launcher, "--nproc-per-node", str(entry.nproc), "-m", "hpcml", *args]
                proc = subprocess.run(
                    [sys.executable, *cmd, "--quiet"],
                    cwd=work,
                    env=hpcml_env(),
                    capture_output=True,
                    text=True,
                    timeout=600,
                )
            else:  # `hpcml train`, forked from the pre-imported server (tests/conftest.py)
                proc = hpcml_proc([*args, "--nproc", str(entry.nproc), "--quiet"], work, timeout=600)
            done[name] = (proc, run_dir)
        return done[name]

    return run


def _leaves(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in d.items():
        if isinstance(value, dict) and value:
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _check_training(
    name: str, entry: Train, proc: subprocess.CompletedProcess[str], run: Path, work: Path
) -> None:
    assert proc.returncode == 0, _fail_text(proc, f"hpcml train examples/{name}")
    s = summary(run)
    assert s["status"] == "finished" and s["steps"] == entry.steps
    assert s["world_size"] == entry.nproc

    # As written: every setting of the file reached the run, except the overridden ones.
    overridden = [o.split("=", 1)[0] for o in entry.overrides]
    written = _leaves(yaml.safe_load((EXAMPLES_DIR / name).read_text()))
    used = _leaves(s["config"])
    changed = {
        key: (value, used.get(key))
        for key, value in written.items()
        if not any(key == o or key.startswith(o + ".") for o in overridden)
        and used.get(key) != value
    }
    assert not changed, f"settings of examples/{name} that the run did not use: {changed}"

    # The strategy was applied: parameters (fp32 masters) and AdamW state are split as planned.
    params = s["model"]["parameters"]
    for i, rank in enumerate(s["memory"]["per_rank"]):
        split = round(4 * params / rank["params_bytes"])
        assert split == entry.param_shards, (
            f"rank {i} holds 1/{split} of the parameters, not 1/{entry.param_shards}: {rank}"
        )
        if entry.optimizer_shards is not None:
            split = round(8 * params / rank["optimizer_bytes"])
            assert split == entry.optimizer_shards, (
                f"rank {i} holds 1/{split} of AdamW's state, not 1/{entry.optimizer_shards}: {rank}"
            )

    # The example's data path found what its header says to prepare.
    if entry.needs == TOKENS_HOW:
        meta = json.loads((work / "data" / "pystdlib" / "meta.json").read_text())
        assert s["data"]["fingerprint"] == meta["fingerprint"]
    elif entry.needs == CIFAR_HOW:
        assert s["data"]["train_samples"] == 5 * CIFAR_SAMPLES_PER_BATCH


def _check_tuning(name: str, entry: Tune, work: Path) -> None:
    out = work / "runs" / Path(name).stem
    args = ["tune", f"examples/{name}", *entry.overrides, "--workers", str(entry.workers)]
    proc = _hpcml([*args, "--trials", str(entry.trials), "--out", str(out), "--json"], work)
    assert proc.returncode == 0, _fail_text(proc, f"hpcml tune examples/{name}")
    result = json.loads(proc.stdout)
    n = result["trials"]
    assert n["complete"] + n["pruned"] == entry.trials and n["complete"] >= 1, result
    # Every dimension of the file's space was searched, within its range or choices.
    space = yaml.safe_load((EXAMPLES_DIR / name).read_text())["tune"]["space"]
    assert set(result["best_params"]) == set(space)
    for key, value in result["best_params"].items():
        dim = space[key]
        assert value in dim["choices"] if "choices" in dim else dim["low"] <= value <= dim["high"]
    used = yaml.safe_load((Path(result["best_run"]) / "config.yaml").read_text())
    assert used["optim"]["lr"] == result["best_params"]["optim.lr"]
    _check_ties(result)


def _check_ties(result: dict[str, Any]) -> None:
    """The best accuracy's standard error is on its run's validation samples (read here from
    its run.jsonl), and the trials tied with it are the complete ones within it (their
    trial.json values)."""
    evals = [json.loads(line) for line in (Path(result["best_run"]) / "run.jsonl").open()]
    n = [e for e in evals if e.get("kind") == "eval"][-1]["val_samples"]
    p = result["best_value"]
    assert result["best_scored_on"] == n
    assert abs(result["best_standard_error"] - (p * (1 - p) / n) ** 0.5) < 1e-12
    values = {}
    for trial in Path(result["best_run"]).parent.glob("trial-*/trial.json"):
        info = json.loads(trial.read_text())
        if info["status"] == "complete" and info["trial"] != result["best_trial"]:
            values[info["trial"]] = info["value"]
    tied = sorted(t for t, v in values.items() if p - v <= result["best_standard_error"])
    assert sorted(result["tied_with_best"]) == tied, (values, result)


@pytest.mark.parametrize("name", EXAMPLE_FILES)
def test_example_runs_as_written(name: str, request: pytest.FixtureRequest) -> None:
    entry = EXAMPLES.get(name)
    if entry is None:
        pytest.fail(
            f"examples/{name} has no entry in EXAMPLES of {Path(__file__).name}: add how its "
            "header runs it and the overrides that make the run short."
        )
    work: Path = request.getfixturevalue("work")
    trained: Callable[[str], Trained] = request.getfixturevalue("trained")
    if isinstance(entry, Train):
        proc, run = trained(name)
        _check_training(name, entry, proc, run, work)
    elif isinstance(entry, Tune):
        _check_tuning(name, entry, work)
    else:
        _check_serving(name, entry, work, trained)


def test_every_entry_is_a_file_in_examples() -> None:
    stale = sorted(set(EXAMPLES) - set(EXAMPLE_FILES))
    assert not stale, f"EXAMPLES has entries for files not in examples/: {stale}"


@pytest.mark.parametrize("name", sorted(n for n, e in EXAMPLES.items() if e.needs))
def test_first_line_says_how_to_get_the_data(name: str) -> None:
    first = (EXAMPLES_DIR / name).read_text().splitlines()[0]
    how = EXAMPLES[name].needs
    assert how is not None and how in first, f"examples/{name} line 1: {first!r}"


@pytest.mark.parametrize(
    "name", sorted(n for n, e in EXAMPLES.items() if isinstance(e, Train) and e.needs)
)
def test_without_its_data_an_example_fails_saying_how_to_get_it(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the example's relative data.path points at nothing here
    how = EXAMPLES[name].needs
    assert how is not None
    with pytest.raises(DataError, match="^[^\n]+$") as exc:
        load_source(load_config(EXAMPLES_DIR / name).data)
    assert how in str(exc.value)


def test_cifar10_without_its_data_exits_2_saying_how_to_get_it(tmp_path: Path) -> None:
    work = _folder_with_examples(tmp_path / "work")
    proc = _hpcml(
        ["train", "examples/cifar10_resnet18.yaml", "--run-dir", "runs/c", "--quiet"], work
    )
    assert proc.returncode == 2, _fail_text(proc, "hpcml train without data")
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert CIFAR_HOW in lines[0] and "data/cifar10" in lines[0]
    assert not (work / "runs" / "c").exists()


def _free_port() -> int:
    sock = bind_socket("127.0.0.1", 0)
    port = int(sock.getsockname()[1])
    sock.close()
    return port


def _wait_ready(proc: subprocess.Popen[str], url: str, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"hpcml serve exited {proc.returncode} before ready:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/v2/health/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    pytest.fail(f"hpcml serve was not ready after {timeout_s:g} s:\n{log.read_text()}")


def _check_serving(name: str, entry: Serve, work: Path, trained: Callable[[str], Trained]) -> None:
    # What the header says to make: the digits run, its INT8 ONNX export (the function
    # `hpcml export onnx --int8` calls, without its accuracy and speed report, which cost
    # ~10 s), then versions 1 and 2 copied from it.
    proc, run = trained(entry.trains)
    assert proc.returncode == 0, _fail_text(proc, f"hpcml train examples/{entry.trains}")
    assert run == work / "runs" / "digits-int8"
    export_onnx(run, int8=True, val_limit=16, speed_budget_s=0.01)
    for version in ("1", "2"):
        shutil.copytree(run / "export", work / "runs" / "repo" / "digits" / version)

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = hpcml_env()
    env.pop("HPCML_ADMIN_TOKEN", None)  # the example's admin endpoints stay off without it
    log = work / "serve.log"
    with log.open("w") as out:
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "hpcml",
                "serve",
                "runs/repo",
                "--config",
                f"examples/{name}",
                "--port",
                str(port),
            ],
            cwd=work,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )
    try:
        _wait_ready(server, url, log, timeout_s=120)
        x = np.random.default_rng(0).standard_normal((2, 3, 32, 32), dtype=np.float32)
        body = {
            "inputs": [
                {
                    "name": "input",
                    "shape": [2, 3, 32, 32],
                    "datatype": "FP32",
                    "data": x.reshape(-1).tolist(),
                }
            ]
        }
        with httpx.Client(base_url=url, timeout=60) as client:
            meta = client.get("/v2/models/digits").json()
            assert meta["versions"] == list(entry.versions)
            assert meta["inputs"][0]["shape"] == [-1, 3, 32, 32]
            for version in entry.versions:
                r = client.post(f"/v2/models/digits/versions/{version}/infer", json=body)
                assert r.status_code == 200, (version, r.text)
                out = r.json()
                assert out["model_version"] == version
                assert out["outputs"][0]["shape"] == [2, 10]
                assert out["outputs"][0]["datatype"] == "FP32"
                assert len(out["outputs"][0]["data"]) == 20
            # Unversioned: the canary split sends it to 1 or 2 (and may mirror it to 3).
            r = client.post("/v2/models/digits/infer", json=body)
            assert r.status_code == 200 and r.json()["model_version"] in ("1", "2"), r.text
            assert client.get("/admin/models").status_code == 403
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) in (0, -signal.SIGTERM), log.read_text()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


# The demo's claim (README.md, docs/getting-started.md, the Makefile): >= 97% validation
# accuracy with examples/digits_cnn.yaml as committed (train.seed=0). Seeds 0, 1 and 2 of that
# config (`make demo` with train.seed=S, 2 processes, one 2-core x86-64 machine) reached
# 0.9889, 0.9805 and 0.9889 (355, 352 and 355 of the 359 validation samples; 0.97 is 349):
# the worst seed is 3 samples above the bar, the committed seed 6.
DEMO = "digits_cnn.yaml"
DEMO_MIN_ACCURACY = 0.97
DEMO_PAGES = (ROOT / "README.md", ROOT / "docs" / "getting-started.md")
# How far the pages' numbers (from a `make demo` run) may be from this run's. The same seed
# on another CPU rounds differently: forcing this machine's kernels to AVX2
# (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2) moved val_loss 0.0546 -> 0.0553 and
# scalar/SSE4.1 kernels to 0.0602, each one validation sample fewer right. Tolerances: 3 of
# the 359 samples, and 0.01 of loss (1.8x the largest move seen); the pages' old 0.0430 was
# 0.0116 off.
DEMO_TOLERANCE = {"val_accuracy": 3 / 359, "val_loss": 0.01}


def _demo_block(page: Path) -> dict[str, str]:
    """The rows of the summary table the page shows for `make demo` (`│ key │ value │`)."""
    text = page.read_text()
    start = text.index("run runs/demo")
    rows = re.findall(r"^│ ([^│]+?)\s+│\s+([^│]+?)\s*│$", text[start:], re.M)
    return {key: value for key, value in rows if key != "..."}


def test_the_demo_reaches_97_percent_and_the_pages_show_its_numbers(
    trained: Callable[[str], Trained],
) -> None:
    proc, run = trained(DEMO)
    assert proc.returncode == 0, _fail_text(proc, f"hpcml train examples/{DEMO}")
    s = summary(run)
    final = s["final"]
    assert s["config"]["train"]["seed"] == 0 and s["steps"] == 150
    assert final["val_accuracy"] >= DEMO_MIN_ACCURACY, final
    for page in DEMO_PAGES:
        shown = _demo_block(page)
        where = f"{page.relative_to(ROOT)}'s demo output"
        assert shown["steps"] == str(s["steps"]), where
        assert shown["processes x device"] == f"{s['world_size']} x {s['device']['type']}", where
        assert shown["precision"] == s["config"]["precision"], where
        for key, tolerance in DEMO_TOLERANCE.items():
            assert abs(float(shown[key]) - final[key]) <= tolerance, (
                f"{where} shows {key} {shown[key]}; a fresh run gives {final[key]:.4f}"
            )
