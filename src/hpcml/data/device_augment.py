"""Image augmentation on the training device (`data.augment_on: device`): normalization,
random crop with reflect padding 4 and horizontal flip over the whole batch after it reached
the device, and optional mixup (`data.mixup_alpha`) / cutmix (`data.cutmix_alpha`) with soft
targets.

Normalization moves with them where the source stores 8-bit pixels (cifar10, image shard
sets): the loader then hands over uint8 batches, a quarter of float32's bytes through workers,
pinned memory and the host-to-device copy, and `DeviceNormalize` turns every batch, training
and evaluation alike, into the float inputs the CPU path gives (the same `normalize_pixels`),
so what the model sees, its exports and serving are unchanged. Reflect padding, flips, crops
and convex mixes commute with a per-channel affine map, so normalizing first changes nothing.

Same transforms as the CPU path (`hpcml.data.sources.AugmentedImages`: offsets 0..8 in each
axis, one flip in two), but as a handful of batched tensor ops (one gather, one `where`) instead
of a per-sample Python loop in the loader workers.

Randomness is a function of (seed, data-parallel rank, step, micro-batch) alone: each
micro-batch reseeds a torch.Generator on the device from those numbers (a `SeedSequence`
hash), and draws mixup/cutmix's per-batch scalars (Beta draws, box) from a numpy generator
seeded the same way. So a resumed run, which restores the step, augments exactly as an
uninterrupted one, with no generator state in the checkpoint; tensor-parallel ranks that share
a batch share its augmentation (they share the data-parallel rank).

Hand-written rather than torchvision.transforms.v2: v2's RandomCrop/RandomHorizontalFlip on a
batched tensor draw one crop and one flip for the whole batch, not one per sample, and draw from
torch's global generator, which a resume does not restore. The mixup/cutmix formulas are the
papers' (Zhang et al. 2018; Yun et al. 2019): lambda ~ Beta(alpha, alpha), the cutmix box of
area (1 - lambda) clipped to the image, lambda then set to the share of pixels kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from hpcml.config import RunConfig

PAD = 4


def normalize_pixels(
    x: torch.Tensor, scale: float, mean: tuple[float, ...], std: tuple[float, ...]
) -> torch.Tensor:
    """(x * scale - mean) / std per channel (dim -3) of uint8 pixels (C, H, W) or (B, C, H, W),
    in float32 on x's device. The one implementation both paths use."""
    shape = (-1, 1, 1)
    m = torch.tensor(mean, dtype=torch.float32, device=x.device).view(shape)
    s = torch.tensor(std, dtype=torch.float32, device=x.device).view(shape)
    return (x.to(torch.float32) * scale - m) / s


@dataclass(frozen=True)
class DeviceNormalize:
    """A source's normalization, left to the device (`data.augment_on: device`)."""

    scale: float
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return normalize_pixels(x, self.scale, self.mean, self.std)


def batch_seed(seed: int, rank: int, step: int, micro: int) -> int:
    """A 63-bit seed for one micro-batch, hashed from the numbers that identify it."""
    state = np.random.SeedSequence([seed, rank, step, micro]).generate_state(1, np.uint64)
    return int(state[0] >> np.uint64(1))


def crop_flip(x: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample random crop (reflect pad 4, offsets 0..8) and flip of a (B, C, H, W) batch.

    Returns the batch and the draws (B, 3): dy, dx, flipped (for tests and inspection)."""
    b, c, h, w = x.shape
    dev = x.device
    dy = torch.randint(0, 2 * PAD + 1, (b,), generator=gen, device=dev)
    dx = torch.randint(0, 2 * PAD + 1, (b,), generator=gen, device=dev)
    flip = torch.rand(b, generator=gen, device=dev) < 0.5
    padded = F.pad(x, (PAD, PAD, PAD, PAD), mode="reflect")
    rows = (dy[:, None] + torch.arange(h, device=dev))[:, None, :, None]  # (B, 1, H, 1)
    cols = (dx[:, None] + torch.arange(w, device=dev))[:, None, None, :]  # (B, 1, 1, W)
    bi = torch.arange(b, device=dev)[:, None, None, None]
    ci = torch.arange(c, device=dev)[None, :, None, None]
    out = padded[bi, ci, rows, cols]
    out = torch.where(flip[:, None, None, None], out.flip(-1), out)
    return out, torch.stack([dy, dx, flip.long()], dim=1)


def mix(
    x: torch.Tensor,
    y: torch.Tensor,
    num_classes: int,
    gen: torch.Generator,
    rng: np.random.Generator,
    mixup_alpha: float,
    cutmix_alpha: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixup or cutmix (one of the two per batch, evenly, when both alphas are set) of a batch
    with a permutation of itself. Returns the mixed batch and soft targets (B, num_classes)
    whose rows sum to 1."""
    b = x.shape[0]
    perm = torch.randperm(b, generator=gen, device=x.device)
    use_cutmix = cutmix_alpha > 0 and (mixup_alpha <= 0 or rng.random() < 0.5)
    if use_cutmix:
        lam = float(rng.beta(cutmix_alpha, cutmix_alpha))
        h, w = x.shape[-2:]
        cut = np.sqrt(1.0 - lam)
        ch, cw = int(h * cut), int(w * cut)
        cy, cx = int(rng.integers(h)), int(rng.integers(w))
        y0, y1 = max(cy - ch // 2, 0), min(cy + ch // 2, h)
        x0, x1 = max(cx - cw // 2, 0), min(cx + cw // 2, w)
        mixed = x.clone()
        mixed[..., y0:y1, x0:x1] = x[perm][..., y0:y1, x0:x1]
        lam = 1.0 - (y1 - y0) * (x1 - x0) / (h * w)  # the share of pixels kept
    else:
        lam = float(rng.beta(mixup_alpha, mixup_alpha))
        mixed = lam * x + (1.0 - lam) * x[perm]
    one_hot = F.one_hot(y, num_classes).to(x.dtype)
    target = lam * one_hot + (1.0 - lam) * one_hot[perm]
    return mixed, target


@dataclass
class DeviceAugment:
    """The trainer's per-micro-batch hook: `apply(x, y, step, micro)` after the batch reached
    the device."""

    seed: int
    rank: int
    num_classes: int
    crop_and_flip: bool = True
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0

    def apply(
        self, x: torch.Tensor, y: torch.Tensor, step: int, micro: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        key = batch_seed(self.seed, self.rank, step, micro)
        gen = torch.Generator(device=x.device)
        gen.manual_seed(key)
        if self.crop_and_flip:
            x, _ = crop_flip(x, gen)
        if self.mixup_alpha > 0 or self.cutmix_alpha > 0:
            rng = np.random.default_rng(key)
            x, y = mix(x, y, self.num_classes, gen, rng, self.mixup_alpha, self.cutmix_alpha)
        return x, y


def device_augment(cfg: RunConfig, rank: int, num_classes: int) -> DeviceAugment | None:
    """The run's device augmentation, or None where data.augment_on is cpu (or augment off)."""
    d = cfg.data
    if not (d.augment and d.augment_on == "device"):
        return None
    return DeviceAugment(cfg.train.seed, rank, num_classes, True, d.mixup_alpha, d.cutmix_alpha)
