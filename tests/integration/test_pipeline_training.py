"""Pipeline parallelism (`parallel.pp=2`) of gpt-tiny on 2 CPU processes (gloo), end to end
through torchrun, against one process at the same global batch:

- 1F1B gives the one-process loss and global gradient norm at every step (fp32, 1e-5
  relative), with gradient clipping active at every step (so a norm taken per stage would
  clip differently and change the losses);
- evaluation under pp (a last validation batch smaller than the others) and the export (both
  stages' weights, under the whole model's names) match the one-process run;
- the 2 stages' checkpoint of step 3 resumes on 2 stages under GPipe (pp2 -> pp2, each rank
  its own state) and on one process (pp2 -> pp1) with the 1F1B run's losses, and the one
  process's on 2 stages (pp1 -> pp2) with the one process's;
- SIGUSR1 to the last stage's rank stops both stages at the same step with a checkpoint and
  exit code 75, and `--resume auto` continues bit for bit like the uninterrupted 1F1B run; the
  straggler check names the slowed stage, not the one waiting for it;
- a stage that hangs (2 stages per rank, interleaved) is named by the watchdog, which ends the
  job long before the collective timeout;
- every schedule (GPipe, 1F1B, interleaved 1F1B, zero-bubble) gives the whole model's loss,
  gradients, global norm and evaluation logits for one step, in one launch of a worker;
- a layout the stages cannot take is refused by the launcher.

One module fixture runs each training once; the tests read their run folders.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from tests.conftest import hpcml_env, hpcml_proc, run_hpcml, summary
from tests.conftest import step_losses as losses

from hpcml.data.sources.tokens import prepare_pystdlib
from hpcml.errors import REQUEUE_EXIT_CODE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PP = ["parallel.pp=2", "parallel.pp_schedule=1f1b", "parallel.microbatches=4"]
# The pipeline sums a step's gradients over 4 micro-batches (GPipe: 2) where one process takes
# the batch whole: fp32 sums in another order (~6e-8 relative each), grown over 6 AdamW steps.
# 1e-5 is the bound.
REL = 1e-5
STEPS = 6
CLIP = 0.05  # below every step's gradient norm (asserted): clipping acts at every step

CONFIG = """
model: {{name: gpt-tiny, args: {{tie_embeddings: false}}}}
data: {{source: tokens, path: {corpus}, seq_len: 64, batch_size: 8, eval_windows: 20}}
optim: {{name: adamw, lr: 0.003, warmup_steps: 2, grad_clip: {clip}}}
train: {{max_steps: {steps}, eval_every: 0, checkpoint_every: 3, keep_last: 2, log_every: 3}}
precision: fp32
"""


def records(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    lines = (run_dir / "run.jsonl").read_text().splitlines()
    return [rec for rec in map(json.loads, lines) if rec.get("kind") == kind]


def grad_norms(run_dir: Path) -> dict[int, float]:
    return {int(rec["step"]): rec["grad_norm"] for rec in records(run_dir, "step")}


def train(config: Path, run_dir: Path, nproc: int, *overrides: str, resume: str = "") -> None:
    args = ["train", str(config), *overrides, "--run-dir", str(run_dir), "--quiet"]
    args += ["--resume", resume] if resume else []
    # Forked from the pre-imported server (conftest); with --nproc, torchrun's agent runs in
    # that process and forks the workers (hpcml.launch.forked_workers): no new interpreter.
    out = hpcml_proc(args + (["--nproc", str(nproc)] if nproc > 1 else []), timeout=600)
    assert out.returncode == 0, f"{args} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pipeline")
    corpus = root / "pystdlib"
    prepare_pystdlib(corpus, val_fraction=0.2, max_bytes=200_000)
    config = root / "gpt_tiny.yaml"
    config.write_text(CONFIG.format(corpus=corpus, clip=CLIP, steps=STEPS))
    out = {"config": config, "single": root / "single", "1f1b": root / "1f1b"}
    train(config, out["single"], 1)
    train(config, out["1f1b"], 2, *PP)
    return out


def test_same_loss_and_grad_norm_every_step_as_one_process(runs: dict[str, Path]) -> None:
    want, got = losses(runs["single"]), losses(runs["1f1b"])
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=REL), f"step {step}"
    assert want[STEPS] < want[1]  # it did learn something
    want_norm, got_norm = grad_norms(runs["single"]), grad_norms(runs["1f1b"])
    assert min(want_norm.values()) > CLIP  # clipping acted at every step
    for step in want_norm:
        # The norm over both stages' gradients (a stage's own norm is ~70% of it).
        assert got_norm[step] == pytest.approx(want_norm[step], rel=REL), f"norm step {step}"
    s = summary(runs["1f1b"])
    assert s["config"]["parallel"]["pp"] == 2 and s["world_size"] == 2
    # The planner's bubble (p - 1) / (m + p - 1) = 1 / 5 beside each rank's measured idle share
    # (not compared: on a shared CPU it is whatever the neighbours leave; the benchmark has it).
    assert s["prediction"]["pipeline"]["predicted_bubble"] == pytest.approx(1 / 5)
    assert len(s["pipeline"]["measured_bubble_per_rank"]) == 2
    assert all(0 <= b < 1 for b in s["pipeline"]["measured_bubble_per_rank"])
    # Saved activations at their peak in step 2: 1F1B at M = 4 holds 2 micro-batches on the
    # first stage and 1 on the last, as the planner says (each micro-batch saves the same
    # tensors, so the peak is a whole number of them: 5% leaves room for shared storages).
    stages = s["prediction"]["stages"]
    assert [st["predicted_inflight_microbatches"] for st in stages] == [2, 1]
    for st in stages:
        assert st["measured_inflight_microbatches"] == pytest.approx(
            st["predicted_inflight_microbatches"], rel=0.05
        ), st


def test_evaluation_and_export_match_one_process(runs: dict[str, Path]) -> None:
    want, got = summary(runs["single"])["final"], summary(runs["1f1b"])["final"]
    # 20 windows in batches of 16 and 4: the pipeline's evaluation takes any batch size.
    assert got["val_samples"] == want["val_samples"] == 20
    assert got["val_batches_per_rank"] == want["val_batches_per_rank"] == 2
    assert got["val_loss"] == pytest.approx(want["val_loss"], rel=REL)
    single = load_file(str(runs["single"] / "export" / "model.safetensors"))
    piped = load_file(str(runs["1f1b"] / "export" / "model.safetensors"))
    assert sorted(piped) == sorted(single)  # both stages' weights, the whole model's names
    for name, tensor in single.items():
        # Weights after 6 AdamW steps from the same losses (REL above), elementwise.
        assert torch.allclose(piped[name], tensor, rtol=1e-4, atol=1e-6), name


def test_pipeline_checkpoint_resumes_on_one_process(runs: dict[str, Path], tmp_path: Path) -> None:
    """The 2 stages' checkpoint of step 3 (each stage wrote its own parameters and AdamW
    state) continues on one process with the pipeline run's losses for steps 4-6."""
    ckpt = runs["1f1b"] / "checkpoints" / "step-3"
    train(runs["config"], tmp_path / "one", 1, resume=str(ckpt))
    want, got = losses(runs["1f1b"]), losses(tmp_path / "one")
    assert sorted(got) == [4, 5, 6]
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=REL), step


def test_pipeline_checkpoint_resumes_on_two_stages_under_gpipe(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """The same checkpoint on 2 stages again, now under GPipe with 2 micro-batches: each
    stage finds its own parameters, AdamW state and param groups, and steps 4-6 are the
    1F1B run's (the schedule changes the order of the sums only)."""
    ckpt = runs["1f1b"] / "checkpoints" / "step-3"
    gpipe = ["parallel.pp=2", "parallel.pp_schedule=gpipe", "parallel.microbatches=2"]
    train(runs["config"], tmp_path / "gpipe", 2, *gpipe, resume=str(ckpt))
    want, got = losses(runs["1f1b"]), losses(tmp_path / "gpipe")
    assert sorted(got) == [4, 5, 6]
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=REL), step
    assert summary(tmp_path / "gpipe")["pipeline"]["predicted_bubble"] == pytest.approx(1 / 3)


def test_one_process_checkpoint_resumes_on_two_stages(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """pp1 -> pp2: the one-process checkpoint of step 3 (one file set of the whole model and its
    AdamW state) continues on 2 stages, each taking its own entries, with the one-process
    losses for steps 4-6 (1e-5: the pipeline's sums in another order, as above)."""
    ckpt = runs["single"] / "checkpoints" / "step-3"
    train(runs["config"], tmp_path / "pp2", 2, *PP, resume=str(ckpt))
    want, got = losses(runs["single"]), losses(tmp_path / "pp2")
    assert sorted(got) == [4, 5, 6]
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=REL), step
    assert summary(tmp_path / "pp2")["resumed_from"] == str(ckpt)


def test_sigusr1_to_one_stage_stops_both_at_one_step_and_resumes_exactly(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """The 1F1B run again with rank 1 (the last stage) slowed: 0.4 s in each micro-batch's
    forward (numerics unchanged), so that steps 4-6 outlast the signal's delivery. Once step
    3's checkpoint exists, SIGUSR1 goes to rank 1 only. The stop is agreed every step
    (fault.preempt_check_every=1): both stages stop after the same step, save it, and the job
    exits 75; the resume ends the run with the uninterrupted run's losses, bit for bit.
    The straggler check (every 2 steps) names rank 1: its compute, not rank 0's wait for it,
    which a span from a forward to its last gradient would have counted on rank 0 too."""
    run = tmp_path / "run"
    faults = ["fault.preempt_check_every=1", "fault.straggler_every=2"]
    args = ["train", str(runs["config"]), *PP, *faults]
    args += ["--nproc", "2", "--run-dir", str(run), "--quiet"]
    slow = json.dumps({"slow": {"rank": 1, "seconds": 0.4}})
    with ThreadPoolExecutor(1) as pool:
        job = pool.submit(hpcml_proc, args, env=hpcml_env(HPCML_FAULT_INJECT=slow), timeout=300)
        rank1 = run / "pids" / "rank-1.pid"
        deadline = time.monotonic() + 240
        while not ((run / "checkpoints" / "step-3").is_dir() and rank1.exists()):
            assert not job.done() and time.monotonic() < deadline, "no step-3 checkpoint"
            time.sleep(0.05)
        os.kill(int(rank1.read_text()), signal.SIGUSR1)
        out = job.result()
    assert out.returncode == REQUEUE_EXIT_CODE, out.stderr[-3000:]
    event = [r for r in records(run, "fault") if r["event"] == "preempted"]
    assert len(event) == 1
    at = event[0]["step"]
    assert 3 < at < STEPS  # after the signal, before the run's end
    saved = run / "checkpoints" / f"step-{at}"
    assert {p.name for p in saved.glob("rank-*.pt")} == {"rank-0.pt", "rank-1.pt"}
    assert max(losses(run)) == at and summary(run)["status"] == "preempted"
    stragglers = [
        (r["step"], r["rank"]) for r in records(run, "fault") if r["event"] == "straggler"
    ]
    assert stragglers == [(2, 1), (4, 1)]

    train(runs["config"], run, 2, *PP, resume="auto")
    assert summary(run)["resumed_from"] == str(saved)
    assert losses(run) == losses(runs["1f1b"])  # every step, bit for bit


def test_watchdog_names_a_hung_stage_with_two_stages_per_rank(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """Rank 1 (stages 1 and 3 of 4, interleaved 1F1B) hangs in its first forward of step 3 (an
    injected sleep, which fires only if the fault hooks reach the stages the schedule runs);
    rank 0 waits for it in a pipeline receive. The watchdog (3 s) names rank 1 and ends the job;
    the collective timeout (300 s) is beyond the command's limit (150 s)."""
    run = tmp_path / "hung"
    interleaved = ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b"]
    interleaved += ["parallel.virtual_stages=2", "parallel.microbatches=2", "model.args.n_layer=4"]
    faults = ["fault.watchdog_s=3", "parallel.timeout_s=300", "train.max_steps=50"]
    args = ["train", str(runs["config"]), *interleaved, *faults, "train.checkpoint_every=0"]
    stall = json.dumps({"stall": {"rank": 1, "step": 3, "seconds": 3600}})
    out = hpcml_proc(
        [*args, "--nproc", "2", "--run-dir", str(run), "--quiet"],
        env=hpcml_env(HPCML_FAULT_INJECT=stall),
        timeout=150,
    )
    assert out.returncode == 1, out.stderr[-3000:]
    assert "rank 1 stopped answering at step 3" in out.stderr
    failed = summary(run)
    assert failed["status"] == "failed" and "rank 1 stopped answering" in failed["error"]


WORKER = Path(__file__).with_name("pipeline_schedules_worker.py")
# One step of fp32 sums in another order than one process's (micro-batches, stages):
# a few ulps (~1e-7 relative) of the largest value; 1e-5 leaves room and no more.
STEP_REL = 1e-5


def test_every_schedule_gives_the_whole_models_gradients(tmp_path: Path) -> None:
    """GPipe, 1F1B, interleaved 1F1B and interleaved zero-bubble (2 stages per rank for the
    last two) on 2 ranks, one launch: the loss, each stage's gradients, the global gradient
    norm and the evaluation forward's logits are the whole model's (pipeline_schedules_worker)."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    out = subprocess.run(
        [*launch, str(WORKER), str(tmp_path)],
        env=hpcml_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    assert set(ranks[0]) == {"gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"}
    for name in ranks[0]:
        zero, one = ranks[0][name], ranks[1][name]
        # Loop placement: with 2 stages per rank, rank 0 holds stages 0 and 2.
        assert zero["stages"] == ([0] if name in ("gpipe", "1f1b") else [0, 2]), name
        # Each parameter on exactly one stage: 4 blocks of 16 tensors, 2 + 3 outside them.
        assert not set(zero["params"]) & set(one["params"]), name
        assert len(zero["params"]) + len(one["params"]) == 4 * 16 + 5, name
        for rank in (zero, one):
            assert rank["grad_rel"] < STEP_REL and rank["norm_rel"] < STEP_REL, (name, rank)
        assert one["loss_rel"] < STEP_REL and one["logits_rel"] < STEP_REL, (name, one)


def test_bad_pipeline_layout_is_refused_before_workers_start(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """The launcher's check (one sentence, exit 2, nothing written) for a layout the workers
    could not build: 3 blocks do not split into 2 equal stages."""
    run_dir = tmp_path / "bad"
    bad = ["parallel.pp=2", "model.args.n_layer=3"]
    args = ["train", str(runs["config"]), *bad, "--nproc", "2", "--run-dir", str(run_dir)]
    proc = run_hpcml(*args, check=False)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "do not divide the model's 3 blocks" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and not run_dir.exists()
