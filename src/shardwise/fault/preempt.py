"""Preemption: SIGTERM (what schedulers and spot instances send) asks the run to stop at a step
boundary with a checkpoint, instead of dying mid-step.

The signal reaches the ranks at slightly different moments, so they agree on when to stop with a
one-element all-reduce every `every` steps (the reporting interval, `tracking.log_every`), where
the ranks meet for the metrics anyway: a collective every step measurably slowed small models on
a busy CPU (bench/ddp_overhead.py). It runs on its own CPU (gloo) group, so it never interleaves
with the training collectives.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist


class Preemption:
    def __init__(self, *, every: int) -> None:
        self.every = every
        self._signalled = False
        self._flag = torch.zeros(1)
        self._group = dist.new_group(backend="gloo")
        self._previous: Any = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signalled = True

    def agreed(self, step: int) -> bool:
        """Call after every step on every rank: True (on all ranks at the same step) once any
        rank has received SIGTERM, at most `every` steps after it arrived."""
        if step % self.every:
            return False
        self._flag.fill_(1.0 if self._signalled else 0.0)
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(self._flag.item() > 0)

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
