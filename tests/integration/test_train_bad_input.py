"""Bad input ends with one sentence, exit code 2, no traceback, and no half-written run."""

from __future__ import annotations

import json
import shutil

from tests.conftest import run_hpcml, step_losses, summary

CONFIG = "examples/digits_cnn.yaml"
FAST = ["model.name=mlp", "train.max_steps=4", "train.eval_every=0", "data.batch_size=16"]


def _assert_user_error(proc, *words):
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    line = proc.stderr.strip()
    assert line.startswith("error:"), line
    for w in words:
        assert w in line, (w, line)


def test_config_errors(tmp_path):
    _assert_user_error(run_hpcml("train", CONFIG, "optim.lr=abc", check=False), "optim.lr", "abc")
    _assert_user_error(run_hpcml("train", CONFIG, "train.bogus=1", check=False), "train.bogus")
    _assert_user_error(run_hpcml("train", str(tmp_path / "nope.yaml"), check=False), "does not exist")
    _assert_user_error(run_hpcml("model", "info", "vgg99", check=False), "vgg99")


def test_missing_data_folder_leaves_no_run_folder(tmp_path):
    run = tmp_path / "run"
    proc = run_hpcml("train", CONFIG, "data.source=cifar10", f"data.path={tmp_path / 'none'}",
                     "--run-dir", str(run), check=False)
    _assert_user_error(proc, "cifar-10")
    assert not run.exists()


def test_too_many_processes(tmp_path):
    proc = run_hpcml("train", CONFIG, "--nproc", "4096", "--run-dir", str(tmp_path / "r"), check=False)
    _assert_user_error(proc, "--nproc 4096")
    assert not (tmp_path / "r").exists()


def test_finished_run_is_not_overwritten_and_checkpoints_survive(tmp_path):
    run = tmp_path / "run"
    run_hpcml("train", CONFIG, *FAST, "--run-dir", str(run), "--quiet")
    before = step_losses(run)
    proc = run_hpcml("train", CONFIG, *FAST, "--run-dir", str(run), check=False)
    _assert_user_error(proc, "already holds a finished run", "--resume", "--overwrite")
    assert step_losses(run) == before and summary(run)["status"] == "finished"
    assert (run / "checkpoints" / "step-4" / "manifest.json").exists()
    run_hpcml("train", CONFIG, *FAST, "optim.lr=0.01", "--run-dir", str(run), "--overwrite", "--quiet")
    assert summary(run)["config"]["optim"]["lr"] == 0.01


def test_resume_auto_skips_partial_and_corrupt_checkpoints(tmp_path):
    run = tmp_path / "run"
    run_hpcml("train", CONFIG, *FAST, "train.checkpoint_every=2", "train.keep_last=5",
              "--run-dir", str(run), "--quiet")
    ckpts = run / "checkpoints"
    # A crash mid-write of step 6 leaves a tmp folder; step-4 is then corrupted on disk.
    shutil.copytree(ckpts / "step-4", ckpts / ".step-6.tmp")
    manifest = json.loads((ckpts / "step-4" / "manifest.json").read_text())
    victim = ckpts / "step-4" / next(f for f in manifest["files"] if f.endswith(".distcp"))
    victim.write_bytes(victim.read_bytes()[:-7] + b"garbage")
    proc = run_hpcml("train", CONFIG, *FAST, "train.max_steps=6", "optim.decay_steps=4",
                     "--run-dir", str(run), "--resume", "auto", "--quiet")
    assert "step-4" in proc.stderr and "previous complete checkpoint" in proc.stderr
    assert summary(run)["resumed_from"].endswith("step-2")
    assert summary(run)["steps"] == 6


def test_explicit_corrupt_or_missing_checkpoint(tmp_path):
    run = tmp_path / "run"
    run_hpcml("train", CONFIG, *FAST, "--run-dir", str(run), "--quiet")
    step = run / "checkpoints" / "step-4"
    (step / "trainer.pt").write_bytes(b"x")
    proc = run_hpcml("train", CONFIG, *FAST, "--run-dir", str(run), "--resume", str(step), check=False)
    _assert_user_error(proc, "trainer.pt")
    proc = run_hpcml("train", CONFIG, *FAST, "--run-dir", str(run), "--resume", str(run / "nope"), check=False)
    _assert_user_error(proc, "does not exist")
    assert summary(run)["status"] == "finished"  # the earlier record still loads


def test_model_cli_lists_and_reports_json():
    out = run_hpcml("model", "list", "--json").stdout
    assert {m["name"] for m in json.loads(out)} >= {"simple_cnn", "resnet18", "mlp"}
    info = json.loads(run_hpcml("model", "info", "simple_cnn", "--json").stdout)
    assert info["parameters"] == 2_474_506 and info["forward_flops_per_sample"] == 83_240_960
