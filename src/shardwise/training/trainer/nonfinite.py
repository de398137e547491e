"""The non-finite check, kept on the device: a step whose gradient norm is NaN or infinite is not
applied, and the host learns of it only at the next reporting step (a log, checkpoint or
evaluation step, where the ranks meet anyway), so a healthy step never waits for the device.

Each step adds two tiny device operations (three under `stop`): the verdict is the norm times
zero, which is 0 for a finite norm and NaN for any other, turned into 1.0 by `nan_to_num`. It is
a float on the device, what fused optimizers take as `found_inf` (1.0: do not apply), so fused
AdamW skips on the device (comm.base.step_optimizers). The host keeps the step's verdict, norm
and loss (the tensors, not their values) until the reporting step reads the verdicts at once.

`fault.on_nonfinite = "skip"` drops the update and counts it. `"stop"` halts every update from
the first bad step on (the state stays the one before it), and at the next reporting step the
trainer saves that state, with the data position and schedule of the bad step, and ends the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Verdicts:
    """What the host reads at a reporting step (the maximum over ranks)."""

    skipped: int
    """Steps whose update was skipped since the run (or this process) started."""
    first_bad: int
    """The first bad step since the last report (under `stop`: since the start); 0 if none."""
    norm: float
    loss: float


@dataclass(frozen=True)
class _Judged:
    step: int
    bad: torch.Tensor
    """1.0 if this step's own gradient norm was not finite, else 0.0 (on the device)."""
    norm: torch.Tensor
    loss: torch.Tensor


class NonFiniteGuard:
    """The record of skipped steps; `verdict` each step, `read` at reporting steps."""

    def __init__(self, device: torch.device, *, stop: bool) -> None:
        self.device, self.stop = device, stop
        self._window: list[_Judged] = []
        self._halted: torch.Tensor | None = None
        """Under `stop`: 1.0 once any step of this process was bad (on the device)."""
        self._skipped = 0
        self._first_bad = 0
        self._positions: dict[int, Any] = {}

    def begin(self, step: int) -> None:
        """Training continues after `step` (0, or the step resumed from)."""
        self._window.clear()
        self._halted = None
        self._skipped = self._first_bad = 0
        self._positions.clear()

    def verdict(self, grad_norm: torch.Tensor, loss: torch.Tensor, step: int) -> torch.Tensor:
        """Whether step `step`'s update must be skipped: 1.0 (skip) or 0.0 (apply), a float on
        the device (a fused optimizer's `found_inf`)."""
        norm = grad_norm  # no graph: gradients have none
        if norm.dtype != torch.float32:  # found_inf is float32 (a host-side check: no read)
            norm = norm.float()
        bad = norm.mul(0).nan_to_num_(nan=1.0)  # 0 · finite = 0; 0 · ±inf or NaN = NaN → 1
        self._window.append(_Judged(step, bad, grad_norm, loss))
        if not self.stop:
            return bad
        self._halted = bad if self._halted is None else torch.maximum(self._halted, bad)
        return self._halted

    def remember(self, step: int, position: Any) -> None:
        """Under `stop`, where the run was after `step` (data position, schedule), so that a bad
        step found at a later reporting step is saved with its own position."""
        if self.stop:
            self._positions[step] = position

    def position(self, step: int) -> Any:
        return self._positions[step]

    def read(self, group: dist.ProcessGroup | None = None) -> Verdicts:
        """The verdicts so far: the count of skipped steps and the first bad step are the
        maximum over ranks (one small all-reduce; they differ only where ranks judge their own
        gradients, as under local SGD), the norm and loss this rank's own."""
        window, self._window = self._window, []
        if not window and not self._first_bad:  # nothing judged: the same on every rank
            return Verdicts(self._skipped, 0, 0.0, 0.0)
        flags = torch.stack([j.bad for j in window]).tolist() if window else []  # one read
        bad = [j for j, flag in zip(window, flags, strict=True) if flag]
        first = self._first_bad or (bad[0].step if bad else 0)
        skipped = self._skipped + len(bad)  # under `stop` the steps after it are not counted
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            agreed = torch.tensor([skipped, first], dtype=torch.float64, device=self.device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
            skipped, first = (int(v) for v in agreed.tolist())
        norm = loss = 0.0
        if bad:
            norm, loss = float(bad[0].norm), float(bad[0].loss)
        self._skipped = skipped
        if self.stop:
            self._first_bad = first
        if not first:
            self._positions.clear()
        return Verdicts(skipped, first, norm, loss)
