"""SimpleCNN of the CIFAR-10 HPC workshop and a small MLP."""

from __future__ import annotations

import torch
from torch import nn


def _stage(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, kernel_size=3, padding=1),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
    )


class SimpleCNN(nn.Module):
    """Three conv3x3-BN-ReLU-maxpool stages (64, 128, 256) then 4096 -> 512 -> classes.

    For 32x32 inputs and 10 classes this has exactly 2,474,506 parameters, the workshop's figure.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 3) -> None:
        super().__init__()
        self.features = nn.Sequential(_stage(in_channels, 64), _stage(64, 128), _stage(128, 256))
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(256 * 4 * 4, 512),
            nn.ReLU(inplace=True),
            nn.Linear(512, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class MLP(nn.Module):
    """Flatten -> [Linear -> ReLU (-> Dropout)] * depth -> Linear. No BatchNorm, so data
    parallel is exact. `dropout` > 0 adds a Dropout after each ReLU (parameter names shift then;
    at 0, the default, the layout is the one earlier versions wrote)."""

    def __init__(
        self,
        in_features: int = 3 * 32 * 32,
        hidden: int = 256,
        depth: int = 2,
        num_classes: int = 10,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout {dropout} must be in [0, 1)")
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU(inplace=True)]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
