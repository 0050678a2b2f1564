"""`hpcml train` end to end in real processes: run folder contents, exact resume, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tests.conftest import run_hpcml, step_losses, summary, system_binary

from hpcml.models.export import load_export

CONFIG = "examples/digits_cnn.yaml"


def test_run_folder_holds_everything(tmp_path, tiny_args):
    run = tmp_path / "run"
    proc = run_hpcml("train", CONFIG, *tiny_args, "train.max_steps=6", "train.checkpoint_every=3",
                     "train.eval_every=3", "--run-dir", str(run), "--quiet", "--json")
    out = json.loads(proc.stdout)
    assert out["status"] == "finished" and out["steps"] == 6
    assert (run / "config.yaml").exists()
    records = [json.loads(line) for line in (run / "run.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in steps] == list(range(1, 7))
    for key in ("step", "loss", "lr", "samples_per_s", "step_time_s", "data_wait_s"):
        assert all(key in r for r in steps), key
    assert [r["step"] for r in evals] == [3, 6]
    s = summary(run)
    assert 0.0 <= s["final"]["val_accuracy"] <= 1.0 and s["final"]["val_loss"] > 0
    assert s["world_size"] == 1 and s["device"]["type"] == "cpu"
    assert s["model"]["parameters"] == 2_474_506
    assert s["memory"]["params_bytes"] == 2_474_506 * 4
    # AdamW: two fp32 moments per parameter plus one fp32 step counter per parameter tensor (16).
    assert s["memory"]["optimizer_bytes"] == 2 * 2_474_506 * 4 + 16 * 4
    assert s["throughput"]["samples_per_s"] > 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-3", "step-6"]
    model, meta = load_export(run / "export")
    assert meta["architecture"] == "simple_cnn" and meta["input"]["shape"] == [3, 32, 32]
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_resume_in_a_new_process_is_bit_exact(tmp_path, tiny_args):
    """(a) 2N steps straight == N steps, then a new process resuming to 2N, bit for bit, with
    dropout (the torch RNG), augmentation inside two DataLoader workers (per-sample randomness
    and the loader's position) and an epoch boundary."""
    n = 5
    common = [*tiny_args, "optim.decay_steps=10", "optim.warmup_steps=2", "data.limit_train=120",
              "model.name=mlp", "model.args={hidden: 32, dropout: 0.2}", "data.num_workers=2",
              "data.augment=true"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    run_hpcml("train", CONFIG, *common, f"train.max_steps={2 * n}", "--run-dir", str(straight), "--quiet")
    run_hpcml("train", CONFIG, *common, f"train.max_steps={n}", "--run-dir", str(split), "--quiet")
    run_hpcml("train", CONFIG, *common, f"train.max_steps={2 * n}", "--run-dir", str(split),
              "--resume", "auto", "--quiet")
    a, b = step_losses(straight), step_losses(split)
    assert sorted(a) == sorted(b) == list(range(1, 2 * n + 1))
    # limit_train=120 with batch 16 is 7 batches an epoch: the resume crosses an epoch boundary.
    assert all(a[s] == b[s] for s in a), {s: (a[s], b[s]) for s in a if a[s] != b[s]}
    assert summary(split)["resumed_from"].endswith(f"step-{n}")


@pytest.mark.slow
def test_two_process_ddp_matches_one_process_with_twice_the_batch(tmp_path):
    """(b) DDP with per-rank batch B/2 on 2 processes == 1 process with batch B, step by step."""
    common = ["model.name=mlp", "model.args={hidden: 64}", "train.eval_every=0", "train.log_every=4",
              "train.max_steps=8", "train.deterministic=true"]
    one, two = tmp_path / "one", tmp_path / "two"
    run_hpcml("train", CONFIG, *common, "data.batch_size=32", "--run-dir", str(one), "--quiet")
    run_hpcml("train", CONFIG, *common, "data.batch_size=16", "--nproc", "2", "--run-dir", str(two), "--quiet")
    a, b = step_losses(one), step_losses(two)
    assert sorted(a) == sorted(b) == list(range(1, 9))
    for s in a:
        # fp32 gradient sums in another order (gloo allreduce, deterministic on CPU): ~u per step
        # over 8 steps; 1e-5 (~170 u) is an estimate, not a derived bound.
        assert a[s] == pytest.approx(b[s], rel=1e-5), (s, a[s], b[s])
    assert summary(two)["world_size"] == 2

    # `torchrun --nproc-per-node 2 -m hpcml train ...` (an external launcher) trains the same:
    # same ranks, same data shards, same gloo reductions, so the same losses bit for bit.
    import subprocess
    import sys

    from tests.conftest import ROOT, hpcml_env

    ext = tmp_path / "ext"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "hpcml", "train", CONFIG, *common, "data.batch_size=16", "--run-dir", str(ext),
         "--quiet"],
        cwd=ROOT, env=hpcml_env(), capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert step_losses(ext) == b
    s = summary(ext)
    assert s["world_size"] == 2 and s["global_batch"] == 32 and len(s["memory"]["per_rank"]) == 2
    # Accuracy is k/N: abs 1e-6 < 1/N means the same predictions (float formatting only).
    assert summary(one)["final"]["val_accuracy"] == pytest.approx(summary(two)["final"]["val_accuracy"], abs=1e-6)

    # `hpcml report` on these real runs: the speedup it prints is the ratio of the two
    # summaries' samples/s, and the page renders in a real headless browser.
    page = tmp_path / "report" / "index.html"
    shown = json.loads(run_hpcml("report", str(one), str(two), "--out", str(page), "--json").stdout)
    ratio = summary(two)["throughput"]["samples_per_s"] / summary(one)["throughput"]["samples_per_s"]
    assert shown["runs"][1]["speedup"] == pytest.approx(ratio, rel=1e-12)
    assert shown["runs"][1]["scaling_efficiency"] == pytest.approx(ratio / 2, rel=1e-12)
    render_in_chromium(page, tmp_path / "shot.png")


def render_in_chromium(page: Path, shot: Path) -> None:
    """Debian's chromium, headless: the page loads with no console message (the report has no
    script; a broken data: URL or markup would log one) and the screenshot is not blank."""
    import subprocess

    import numpy as np
    from matplotlib.image import imread

    browser = system_binary("chromium", "chromium-browser", installer=".ci/install_chromium.sh")
    proc = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         "--window-size=1300,1600", f"--screenshot={shot}", "--enable-logging=stderr", "--v=1",
         page.as_uri()],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    console = [line for line in proc.stderr.splitlines() if ":CONSOLE" in line]
    assert not console, console  # e.g. INFO:CONSOLE:1] "Uncaught ReferenceError: ..."
    pixels = imread(shot)
    # A blank page is one colour; the report has tables and three plots.
    assert pixels.shape[:2] == (1600, 1300) and float(np.std(pixels)) > 0.05


def test_grad_accumulation_matches_a_larger_batch(tmp_path):
    """(c) 2 DDP ranks x 4 micro-batches of 4 == one batch of 32 on one process, step by step:
    the first three micro-batches run under no_sync, so a sync skipped wrongly (or done on
    every micro-batch and scaled wrongly) changes the losses."""
    common = ["model.name=mlp", "model.args={hidden: 64}", "train.eval_every=0", "train.log_every=3",
              "train.max_steps=6", "train.deterministic=true"]
    acc, big = tmp_path / "acc", tmp_path / "big"
    run_hpcml("train", CONFIG, *common, "data.batch_size=4", "train.grad_accum=4", "--nproc", "2",
              "--run-dir", str(acc), "--quiet")
    run_hpcml("train", CONFIG, *common, "data.batch_size=32", "--run-dir", str(big), "--quiet")
    a, b = step_losses(acc), step_losses(big)
    for s in b:
        # Micro-batch gradients summed in another order than one batch: ~u per step over 6
        # steps; 1e-5 (~170 u) is an estimate, not a derived bound.
        assert a[s] == pytest.approx(b[s], rel=1e-5), (s, a[s], b[s])


def test_precisions_run_on_cpu(tmp_path):
    """bf16 and fp16 autocast change the arithmetic (losses differ from fp32 in some step) but
    stay close to it: the relative gap is bounded by a few units of each format's roundoff
    (bf16 2^-8 = 3.9e-3, fp16 2^-11 = 4.9e-4) accumulated over three layers and three steps."""
    common = ["model.name=mlp", "train.max_steps=3", "train.eval_every=0", "train.log_every=1",
              "data.batch_size=16", "optim.grad_clip=1.0", "train.deterministic=true"]
    losses = {}
    for precision in ("fp32", "bf16", "fp16"):
        run = tmp_path / precision
        run_hpcml("train", CONFIG, *common, f"precision={precision}", "--run-dir", str(run),
                  "--quiet")
        assert summary(run)["precision"] == precision
        losses[precision] = step_losses(run)
    for precision, rel in (("bf16", 3e-2), ("fp16", 5e-3)):
        got, want = losses[precision], losses["fp32"]
        assert sorted(got) == [1, 2, 3]
        assert any(got[s] != want[s] for s in got), f"{precision} ran in fp32 (no autocast)"
        for s in got:
            assert got[s] == pytest.approx(want[s], rel=rel), (precision, s, got[s], want[s])
