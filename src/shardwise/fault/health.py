"""What the ranks tell each other at every reporting step (`tracking.log_every`), in one small
all-gather on a CPU (gloo) group of its own, so it never interleaves with training's collectives:

- Preemption: whether the rank received SIGTERM (what schedulers and spot instances send). The
  signal reaches the ranks at slightly different moments; comparing notes at the same steps makes
  every rank stop at the same step, with a checkpoint, at most `log_every` steps after it came.
- Stragglers: each rank's own work per step (fetching its batch and running forward), measured
  before the first collective that would make it wait for the others (under data parallelism the
  gradient all-reduce happens in backward, where fast ranks wait for slow ones, so whole step
  times are equal by construction). A rank above `factor` × the median for `windows` reporting
  windows in a row is flagged once; its ratio is recorded while it stays slow.

Only at reporting steps: one collective every step measurably slowed small models on a busy CPU
(bench/ddp_overhead.py).
"""

from __future__ import annotations

import signal
import statistics
import threading
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class Health:
    stop: bool = False
    """Some rank received SIGTERM: every rank stops after this step."""
    metrics: dict[str, float] = field(default_factory=dict)
    messages: list[str] = field(default_factory=list)
    """Straggler warnings (meaningful on rank 0)."""


class RankHealth:
    def __init__(self, *, straggler_factor: float, straggler_windows: int) -> None:
        self.factor, self.windows = straggler_factor, straggler_windows
        self._signalled = False
        self._seconds: list[float] = []
        self._streaks: dict[int, int] = {}
        self._group = dist.new_group(backend="gloo")
        self._previous: Any = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signalled = True

    def add(self, seconds: float) -> None:
        """This rank's own work in one step (batch fetch + forward)."""
        self._seconds.append(seconds)

    def check(self) -> Health:
        """Collective: every rank calls it at the same (reporting) steps."""
        mine = statistics.fmean(self._seconds) if self._seconds else 0.0
        self._seconds.clear()
        world = dist.get_world_size()
        sent = torch.tensor([mine, 1.0 if self._signalled else 0.0], dtype=torch.float64)
        gathered = torch.empty(world * 2, dtype=torch.float64)
        dist.all_gather_into_tensor(gathered, sent, group=self._group)
        seconds, flags = gathered.view(world, 2).unbind(1)
        health = Health(stop=bool(flags.max() > 0))
        if self.factor > 0 and world > 1:
            self._stragglers(seconds.tolist(), health)
        return health

    def _stragglers(self, everyone: list[float], health: Health) -> None:
        median = statistics.median(everyone)
        for rank, seconds in enumerate(everyone):
            ratio = seconds / median if median > 0 else 1.0
            self._streaks[rank] = self._streaks.get(rank, 0) + 1 if ratio > self.factor else 0
            if self._streaks[rank] >= self.windows:
                health.metrics[f"straggler/rank{rank}"] = ratio
            if self._streaks[rank] == self.windows:
                health.messages.append(
                    f"rank {rank} is a straggler: its batch fetch + forward takes {ratio:.1f}× "
                    f"the median rank's ({seconds * 1e3:.1f} ms vs {median * 1e3:.1f} ms) for "
                    f"{self.windows} reporting windows in a row"
                )

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
