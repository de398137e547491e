"""The many-models progress line's ETA: the time left, from the time the tasks spent on their
rows. It must not count what the remaining chunks will not wait for: Ray's start and its workers'
(outside the tasks), and each worker's warm-up inside its first task (importing the models'
libraries, compiling statsforecast's numba kernels), which can be most of a first chunk's time."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class Eta:
    """Seconds left for `rows` input rows, over `slots` task slots (the work grows with the
    rows, and the longest chunks run first, so a rate per series would run high)."""

    rows: int
    slots: int
    _workers: set[int] = field(default_factory=set)
    _all: tuple[float, int] = (0.0, 0)
    _warm: tuple[float, int] = (0.0, 0)

    def done(self, rows: int, seconds: float | None = None, worker: int = 0) -> None:
        """A chunk of `rows` finished, after `seconds` inside its task on process `worker`
        (None: lost, no time to learn from)."""
        self.rows -= rows
        if seconds is None:
            return
        self._all = (self._all[0] + seconds, self._all[1] + rows)
        if worker in self._workers:  # not this worker's first chunk: no warm-up in it
            self._warm = (self._warm[0] + seconds, self._warm[1] + rows)
        self._workers.add(worker)

    def seconds(self) -> float:
        """The estimate: from the chunks after each worker's first once there are any, else
        from every chunk; NaN before any has finished."""
        seconds, rows = self._warm if self._warm[1] else self._all
        if not rows:
            return math.nan
        return self.rows * (seconds / rows) / max(self.slots, 1)
