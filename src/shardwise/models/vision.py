"""Small image classifiers for the built-in digits dataset (8×8 grey images, 10 classes)."""

from __future__ import annotations

from pydantic import PositiveInt
from torch import nn


def build_mlp(
    *,
    image_size: PositiveInt = 8,
    hidden: PositiveInt = 128,
    depth: PositiveInt = 2,
    classes: PositiveInt = 10,
) -> nn.Module:
    """A multi-layer perceptron on flattened images."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = image_size * image_size
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


def build_cnn(
    *, image_size: PositiveInt = 8, channels: PositiveInt = 32, classes: PositiveInt = 10
) -> nn.Module:
    """Two 3×3 convolutions, one 2×2 pooling and a linear head."""
    pooled = image_size // 2
    return nn.Sequential(
        nn.Conv2d(1, channels, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(channels, channels * 2, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(channels * 2 * pooled * pooled, 128),
        nn.ReLU(),
        nn.Linear(128, classes),
    )
