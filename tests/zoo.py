"""Models written the way users write them, not the way shardwise's built-ins are: BatchNorm,
tied weights, blocks called in a hand-written `forward` with a reshape between them, half of a
contract. The tests name them by import path (`tests.zoo:...`), as a user's job file would."""

from __future__ import annotations

import torch
from torch import nn


class FailsInEvaluation(nn.Module):
    """Trains like any small classifier; its forward raises in eval mode."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            raise RuntimeError("injected failure in evaluation")
        out: torch.Tensor = self.body(x)
        return out


def fails_in_evaluation() -> nn.Module:
    return FailsInEvaluation()


def bn_cnn(*, channels: int = 8) -> nn.Sequential:
    """The tutorial CNN for 8×8 digits, with batch normalisation after each convolution (whose
    bias BatchNorm would cancel: left out, as ResNets do)."""
    return nn.Sequential(
        nn.Conv2d(1, channels, 3, padding=1, bias=False),
        nn.BatchNorm2d(channels),
        nn.ReLU(),
        nn.Conv2d(channels, 2 * channels, 3, padding=1, bias=False),
        nn.BatchNorm2d(2 * channels),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(2 * channels * 16, 10),
    )
