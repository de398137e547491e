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
