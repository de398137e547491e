"""Preemption: SIGTERM (what schedulers and spot instances send) asks the run to stop at a step
boundary with a checkpoint, instead of dying mid-step.

The signal reaches the ranks at slightly different moments, so they agree on when to stop with a
one-element all-reduce started at the end of every step and read at the end of the next one: it
overlaps a step of compute, and all ranks read the same result, so they stop at the same step. It
runs on its own CPU (gloo) group, so it never interleaves with the training collectives.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist


class Preemption:
    def __init__(self) -> None:
        self._signalled = False
        self._flag = torch.zeros(1)
        self._group = dist.new_group(backend="gloo")
        self._pending: Any = None
        self._previous: Any = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signalled = True

    def agreed(self) -> bool:
        """Call once per step on every rank: True (on all ranks at the same step) once any rank
        has received SIGTERM, at most two steps after it arrived."""
        stop = False
        if self._pending is not None:
            self._pending.wait()
            stop = bool(self._flag.item() > 0)
        self._flag.fill_(1.0 if self._signalled else 0.0)
        self._pending = dist.all_reduce(
            self._flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True
        )
        return stop

    def close(self) -> None:
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
