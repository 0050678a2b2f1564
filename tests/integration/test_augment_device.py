"""`hpcml train` with `data.augment_on: device` (crop + flip + mixup + cutmix on the batch after
its transfer): the model sees other inputs than without augmentation (the first step's loss,
taken before any update from the same initial weights and batch, differs), and a run stopped
at step 2 and resumed reproduces the uninterrupted run's losses bit for bit (the augmentation
is keyed by (seed, rank, step, micro-batch), not by generator state)."""

from __future__ import annotations

from tests.conftest import run_hpcml, step_losses

CONFIG = "examples/digits_cnn.yaml"
COMMON = [
    "model.name=mlp",
    "model.args={hidden: 32}",
    "data.batch_size=16",
    "train.eval_every=0",
    "train.log_every=1",
    "train.max_steps=4",
    "optim.decay_steps=4",  # the split run keeps the 4-step schedule of the straight one
    "train.deterministic=true",
    "--quiet",
]
DEVICE = [
    "data.augment=true",
    "data.augment_on=device",
    "data.mixup_alpha=0.4",
    "data.cutmix_alpha=1.0",
]


def test_device_augmentation_changes_inputs_and_resumes_bit_equal(tmp_path):
    plain, straight, split = tmp_path / "plain", tmp_path / "straight", tmp_path / "split"
    run_hpcml("train", CONFIG, *COMMON, "--run-dir", str(plain))
    run_hpcml("train", CONFIG, *COMMON, *DEVICE, "--run-dir", str(straight))
    run_hpcml("train", CONFIG, *COMMON, *DEVICE, "train.max_steps=2", "--run-dir", str(split))
    run_hpcml("train", CONFIG, *COMMON, *DEVICE, "--run-dir", str(split), "--resume", "auto")
    augmented = step_losses(straight)
    assert sorted(augmented) == [1, 2, 3, 4]
    assert step_losses(split) == augmented
    assert augmented[1] != step_losses(plain)[1]
