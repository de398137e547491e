"""A user model that fails on one rank mid-run, to check how a worker failure is reported."""

import torch
import torch.distributed as dist
from torch import nn


class FailsOnRankOne(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if dist.get_rank() == 1 and self.calls == 3:
            raise RuntimeError("injected failure in forward")
        return self.body(x)


def build_model() -> nn.Module:
    return FailsOnRankOne()
