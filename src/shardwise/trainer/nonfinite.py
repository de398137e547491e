"""The non-finite check, kept on the device: a step whose gradient norm is NaN or infinite is not
applied, and the host learns of it only at the next reporting step (a log, checkpoint or
evaluation step, where the ranks meet anyway), so a healthy step never waits for the device.

Each step adds a few tiny device operations: whether the norm is finite, a count of skipped steps,
and the first bad step's number, norm and loss since the last report. The verdict goes to the
optimizers as a tensor (fused AdamW skips on the device: comm.base.step_optimizers).

`fault.on_nonfinite = "skip"` drops the update and counts it. `"stop"` halts every update from
the first bad step on (the state stays the one before it), and at the next reporting step the
trainer saves that state, with the data position and schedule of the bad step, and ends the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

SKIPPED, FIRST, NORM, LOSS, STEP = range(5)


@dataclass(frozen=True)
class Verdicts:
    """What the host reads at a reporting step (the maximum over ranks)."""

    skipped: int
    """Steps whose update was skipped since the run (or this process) started."""
    first_bad: int
    """The first bad step since the last report (under `stop`: since the start); 0 if none."""
    norm: float
    loss: float


class NonFiniteGuard:
    """The device-side record of skipped steps; `verdict` each step, `read` at reporting steps."""

    def __init__(self, device: torch.device, *, stop: bool) -> None:
        dtype = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64
        self.stop = stop
        self._state = torch.zeros(5, dtype=dtype, device=device)
        self._positions: dict[int, Any] = {}
        self._checked = False
        """Whether any step was judged (fp16's gradient scaler judges its own: nothing to read)."""

    def begin(self, step: int) -> None:
        """Training continues after `step` (0, or the step resumed from)."""
        self._state.zero_()
        self._state[STEP] = step
        self._positions.clear()

    def verdict(self, grad_norm: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        """Whether this step's update may be applied (a boolean tensor on the device)."""
        self._checked = True
        state = self._state
        state[STEP] += 1
        bad = ~torch.isfinite(grad_norm)
        first = bad & (state[FIRST] == 0)
        found = torch.stack([state[STEP], grad_norm.to(state.dtype), loss.to(state.dtype)])
        state[FIRST:STEP] = torch.where(first, found, state[FIRST:STEP])
        state[SKIPPED] += bad.to(state.dtype)
        return state[FIRST] == 0 if self.stop else ~bad

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
        if not self._checked:  # the same on every rank: checking follows the precision
            return Verdicts(0, 0, 0.0, 0.0)
        seen = self._state[: LOSS + 1].clone()
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(seen[: FIRST + 1], op=dist.ReduceOp.MAX, group=group)
        skipped, first, norm, loss = seen.tolist()  # one read of the device
        if not self.stop:
            self._state[FIRST:STEP] = 0
        if not first:
            self._positions.clear()
        return Verdicts(int(skipped), int(first), norm, loss)
