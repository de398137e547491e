"""Image classifiers: small ones for the built-in digits (8×8 grey images, 10 classes), and
ResNet-18/34/50 for images of 32×32 (the digits upsampled, `data.args.image_size = 32`)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Literal

import torch
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


class BasicBlock(nn.Module):
    """ResNet-18/34's block: two 3×3 convolutions and the identity (a 1×1 projection where the
    shape changes) added before the last ReLU."""

    expansion = 1

    def __init__(self, inputs: int, width: int, stride: int) -> None:
        super().__init__()
        out = width * self.expansion
        self.body = nn.Sequential(
            nn.Conv2d(inputs, width, 3, stride=stride, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, out, 3, padding=1, bias=False),
            nn.BatchNorm2d(out),
        )
        self.shortcut = _shortcut(inputs, out, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


class Bottleneck(BasicBlock):
    """ResNet-50's block: 1×1 down to `width`, 3×3 (with the stride, as in torchvision's
    "ResNet v1.5"), 1×1 up to 4 × `width`."""

    expansion = 4

    def __init__(self, inputs: int, width: int, stride: int) -> None:
        nn.Module.__init__(self)
        out = width * self.expansion
        self.body = nn.Sequential(
            nn.Conv2d(inputs, width, 1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.Conv2d(width, out, 1, bias=False),
            nn.BatchNorm2d(out),
        )
        self.shortcut = _shortcut(inputs, out, stride)


def _shortcut(inputs: int, out: int, stride: int) -> nn.Module:
    if stride == 1 and inputs == out:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(inputs, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out))


RESNETS: dict[int, tuple[type[BasicBlock], tuple[int, ...]]] = {
    18: (BasicBlock, (2, 2, 2, 2)),
    34: (BasicBlock, (3, 4, 6, 3)),
    50: (Bottleneck, (3, 4, 6, 3)),
}


def build_resnet(
    *,
    depth: Literal[18, 34, 50] = 18,
    classes: PositiveInt = 10,
    channels: PositiveInt = 3,
    width: PositiveInt = 64,
) -> nn.Sequential:
    """ResNet (He et al., 2016) for small images (32×32, as CIFAR): a 3×3 stem without the
    max-pool, four stages of residual blocks (strides 1, 2, 2, 2; widths `width` × 1, 2, 4, 8),
    global average pooling and a linear head. 18 and 50 layers have 11.2M and 23.5M parameters
    at 10 classes. A sequence of named blocks (`stem`, `stage1_0` …, `head`), so pipeline
    parallelism splits it between residual blocks, and FSDP and activation checkpointing work
    block by block."""
    kind, counts = RESNETS[depth]
    blocks: dict[str, nn.Module] = {
        "stem": nn.Sequential(
            nn.Conv2d(channels, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
        )
    }
    inputs = width
    for stage, count in enumerate(counts):
        planes = width * 2**stage
        for i in range(count):
            stride = 2 if stage > 0 and i == 0 else 1
            blocks[f"stage{stage + 1}_{i}"] = kind(inputs, planes, stride)
            inputs = planes * kind.expansion
    blocks["head"] = nn.Sequential(
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(inputs, classes)
    )
    return nn.Sequential(OrderedDict(blocks))
