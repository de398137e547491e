"""A user model that fails on one rank mid-run, to check how a worker failure is reported."""

import threading
import time

import torch
import torch.distributed as dist
from torch import nn


class FailsOnRankOne(nn.Module):
    def __init__(self, slow_exit_s: float = 0.0) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
        self.calls = 0
        self.slow_exit_s = slow_exit_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if dist.get_rank() == 1 and self.calls == 3:
            if self.slow_exit_s:  # a thread still working (a loader, a flush) delays the exit
                threading.Thread(target=time.sleep, args=(self.slow_exit_s,)).start()
            raise RuntimeError("injected failure in forward")
        return self.body(x)


def build_model(slow_exit_s: float = 0.0) -> nn.Module:
    return FailsOnRankOne(slow_exit_s)
