"""Device augmentation (`data.augment_on: device`): the crop/flip draws have the CPU path's
distribution and each output is a shifted / flipped copy of its input (checked against numpy's
reflect padding, not the module's own code); mixup and cutmix give convex combinations whose
soft targets sum to 1 and carry the mixing share; the config checks name the fix."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hpcml.config import RunConfig
from hpcml.data.device_augment import DeviceAugment, batch_seed, crop_flip, mix
from hpcml.data.sources import AugmentedImages
from hpcml.errors import ConfigError
from hpcml.train.validate import check_augment

SIDE = 32  # the CPU path crops to 32 x 32
N = 8100  # 100 expected per crop offset
N_CPU = 3240  # 40 per offset: the CPU path loops in Python, one sample at a time


def _candidates(img: np.ndarray) -> dict[bytes, tuple[int, int, int]]:
    """Every crop offset (dy, dx) and flip of one (1, SIDE, SIDE) image, by its bytes."""
    padded = np.pad(img, ((0, 0), (4, 4), (4, 4)), mode="reflect")
    out: dict[bytes, tuple[int, int, int]] = {}
    for dy in range(9):
        for dx in range(9):
            crop = padded[:, dy : dy + SIDE, dx : dx + SIDE]
            for flip in (0, 1):
                view = crop[..., ::-1] if flip else crop
                out[np.ascontiguousarray(view).tobytes()] = (dy, dx, flip)
    return out


def _within_binomial(count: int, n: int, p: float) -> bool:
    # 5 standard deviations: a correct sampler falls outside with probability < 6e-7 per
    # count (normal approximation), < 5e-5 over the 83 counts checked per path; the inputs are
    # seeded, so the test is deterministic either way.
    return abs(count - n * p) <= 5 * math.sqrt(n * p * (1 - p))


def _check_draws(draws: list[tuple[int, int, int]]) -> None:
    flips = sum(d[2] for d in draws)
    assert _within_binomial(flips, len(draws), 0.5), flips
    offsets: dict[tuple[int, int], int] = {}
    for dy, dx, _ in draws:
        offsets[(dy, dx)] = offsets.get((dy, dx), 0) + 1
    assert len(offsets) == 81
    for key, count in offsets.items():
        assert _within_binomial(count, len(draws), 1 / 81), (key, count)


def test_crop_flip_matches_the_cpu_path_distribution_and_shifts_pixels():
    img = np.arange(SIDE * SIDE, dtype=np.float32).reshape(1, SIDE, SIDE)
    table = _candidates(img)
    assert len(table) == 162  # every (offset, flip) gives a distinct image: draws are recoverable
    batch = torch.from_numpy(img).expand(N, 1, SIDE, SIDE).contiguous()
    gen = torch.Generator().manual_seed(7)
    out, reported = crop_flip(batch, gen)
    # Each output is exactly one shifted/flipped copy of the original (KeyError otherwise).
    device_draws = [table[o.numpy().tobytes()] for o in out]
    assert device_draws == [tuple(r) for r in reported.tolist()]
    _check_draws(device_draws)
    # The CPU path, on the same image, under the same bound.
    labels = torch.zeros(N_CPU, dtype=torch.long)
    cpu = AugmentedImages(torch.utils.data.TensorDataset(batch[:N_CPU], labels))
    cpu_draws = [table[cpu[(3, 0, i)][0].numpy().tobytes()] for i in range(N_CPU)]
    _check_draws(cpu_draws)


def test_device_augment_is_a_function_of_seed_rank_step_and_micro_batch():
    x = torch.randn(16, 3, SIDE, SIDE, generator=torch.Generator().manual_seed(0))
    y = torch.arange(16) % 10
    aug = DeviceAugment(seed=1, rank=0, num_classes=10, mixup_alpha=0.4, cutmix_alpha=1.0)
    a, ta = aug.apply(x, y, step=5, micro=0)
    b, tb = aug.apply(x, y, step=5, micro=0)
    assert torch.equal(a, b) and torch.equal(ta, tb)  # a resume replays the same batch
    for other in (aug.apply(x, y, 6, 0), aug.apply(x, y, 5, 1)):
        assert not torch.equal(a, other[0])
    rank1 = DeviceAugment(seed=1, rank=1, num_classes=10, mixup_alpha=0.4, cutmix_alpha=1.0)
    assert not torch.equal(a, rank1.apply(x, y, 5, 0)[0])
    assert (
        len({batch_seed(1, r, s, m) for r in range(3) for s in range(50) for m in range(3)}) == 450
    )


def _labelled_batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample i is the constant image i + 1 with label i: a mixed pixel names its sources."""
    x = (torch.arange(b, dtype=torch.float32) + 1)[:, None, None, None].expand(b, 3, 8, 8)
    return x.contiguous(), torch.arange(b)


def test_mixup_is_a_convex_combination_with_soft_targets_summing_to_one():
    b = 12
    x, y = _labelled_batch(b)
    for seed in range(5):
        gen = torch.Generator().manual_seed(seed)
        mixed, target = mix(x, y, b, gen, np.random.default_rng(seed), 0.4, 0.0)
        assert target.shape == (b, b)
        torch.testing.assert_close(target.sum(1), torch.ones(b))  # float32 sums: default tol
        for i in range(b):
            lam = float(target[i, i])
            partner = int(torch.argmax(torch.where(torch.arange(b) == i, -1.0, target[i])))
            if lam > 1 - 1e-6:  # mixed with itself
                partner = i
            expected = lam * x[i] + (1 - lam) * x[partner]
            # one float32 multiply-add per pixel: a few ulps of values up to 12
            torch.testing.assert_close(mixed[i], expected, rtol=1e-5, atol=1e-5)
            assert 0.0 <= lam <= 1.0


def test_cutmix_target_mass_equals_the_share_of_pasted_pixels():
    b = 12
    x, y = _labelled_batch(b)
    pasted_any = False
    for seed in range(8):
        gen = torch.Generator().manual_seed(seed)
        mixed, target = mix(x, y, b, gen, np.random.default_rng(seed), 0.0, 1.0)
        torch.testing.assert_close(target.sum(1), torch.ones(b))
        for i in range(b):
            values = mixed[i].round().long() - 1  # which sample each pixel came from
            shares = torch.bincount(values.flatten(), minlength=b).double() / values.numel()
            # exact: lambda is the pixel share by construction; float32 holds k/192 to 1e-7
            torch.testing.assert_close(shares, target[i].double(), rtol=0, atol=1e-6)
            pasted_any |= bool(shares[i] < 1)
    assert pasted_any


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"augment_on": "device"}, "data.augment is off"),
        ({"augment": True, "mixup_alpha": 0.2}, "run on the device only"),
        ({"augment": True, "cutmix_alpha": 1.0}, "run on the device only"),
    ],
)
def test_config_checks_name_the_fix(overrides, words):
    cfg = RunConfig.model_validate({"data": {"source": "digits", **overrides}})
    with pytest.raises(ConfigError, match=words):
        check_augment(cfg)


def test_device_config_passes_the_checks():
    cfg = RunConfig.model_validate(
        {"data": {"source": "digits", "augment": True, "augment_on": "device", "mixup_alpha": 1}}
    )
    check_augment(cfg)
