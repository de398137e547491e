"""What the ranks tell each other every couple of seconds, in one small all-gather on a CPU
(gloo) group of its own, so it never interleaves with training's collectives:

- Preemption: whether the rank received SIGTERM (what schedulers and spot instances send). The
  signal reaches the ranks at slightly different moments; comparing notes at the same steps makes
  every rank stop at the same step, with a checkpoint, about `interval_s` after it came.
- Stragglers: each rank's own work per step (fetching its batch and running forward), measured
  before the first collective that would make it wait for the others (under data parallelism the
  gradient all-reduce happens in backward, where fast ranks wait for slow ones, so whole step
  times are equal by construction). A rank above `factor` × the median for `windows` reporting
  windows in a row is flagged once; its ratio is recorded while it stays slow. In live recovery
  each replica is a world of its own: the replicas' numbers meet in the coordinator's store
  instead (`replicas`), and a slow replica is named the same way.

How often: every `every` steps, first the reporting interval (`tracking.log_every`), then, from
the step times all ranks just exchanged (so every rank computes the same number), as many steps
as take about `interval_s` (`fault.check_interval_s`). A collective every step, or every 10
steps of a 5 ms step, measurably slowed small models on a busy CPU (bench/ddp_overhead.py).
Where the ranks do not otherwise meet every step (`adaptive` False: asynchronous updates), the
check stays at the reporting interval, where they meet anyway to average the loss: a collective
every couple of seconds would line the workers up behind each other, the waiting async exists to
avoid (bench/comm_strategies.py measures it).
"""

from __future__ import annotations

import signal
import statistics
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from shardwise.common.host_reads import host_side
from shardwise.training.comm.collectives import all_gather_single

_PATIENCE_STEPS, _PATIENCE_FLOOR_S = 4, 10.0
"""After SIGTERM, a rank idle for 4 × the slowest rank's step time (at least 10 s) is stuck."""


@dataclass
class Health:
    stop: bool = False
    """Some rank received SIGTERM: every rank stops after this step."""
    metrics: dict[str, float] = field(default_factory=dict)
    messages: list[str] = field(default_factory=list)
    """Straggler warnings (meaningful on rank 0)."""


class RankHealth:
    def __init__(
        self,
        *,
        straggler_factor: float,
        straggler_windows: int,
        every: int,
        interval_s: float,
        adaptive: bool = True,
        on_signal: Callable[[float], None] | None = None,
        replicas: Callable[[float], dict[int, float]] | None = None,
    ) -> None:
        """`on_signal(patience_s)` is called on SIGTERM, once a step's time is known: a rank that
        waits this long without finishing a step cannot reach the ranks' next check.
        `replicas(own)`: in live recovery, says this replica's own work per step and returns
        every live replica's, by slot (fault/live.LiveGroup.work)."""
        self.factor, self.windows, self.every = straggler_factor, straggler_windows, every
        self.interval_s, self.adaptive = interval_s, adaptive
        self._on_stop = on_signal
        self._slowest = 0.0
        self._signalled = False
        self._seconds: list[float] = []
        self._steps: list[float] = []
        self._streaks: dict[tuple[str, int], int] = {}
        self.replicas = replicas
        self._group = dist.new_group(backend="gloo")
        self._previous: Any = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signalled = True
        step_s = max([self._slowest, *self._steps])
        if self._on_stop is not None and step_s > 0:
            self._on_stop(max(_PATIENCE_FLOOR_S, _PATIENCE_STEPS * step_s))

    def add(self, own: float, step: float) -> None:
        """One step: this rank's own work (batch fetch + forward) and the whole step's time."""
        self._seconds.append(own)
        self._steps.append(step)

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def check(self) -> Health:
        """Collective: every rank calls it at the same steps (where `due`)."""
        own = statistics.fmean(self._seconds) if self._seconds else 0.0
        step = statistics.fmean(self._steps) if self._steps else 0.0
        self._seconds.clear()
        self._steps.clear()
        world = dist.get_world_size()
        with host_side():  # host numbers on a gloo group: no wait for any device
            sent = torch.tensor([own, step, 1.0 if self._signalled else 0.0], dtype=torch.float64)
            gathered = torch.empty(world * 3, dtype=torch.float64)
            all_gather_single(gathered, sent, group=self._group)
            values = gathered.tolist()
        seconds, steps, flags = values[0::3], values[1::3], values[2::3]
        health = Health(stop=max(flags) > 0)
        slowest = self._slowest = max(steps)
        if slowest > 0 and self.adaptive:  # the same numbers everywhere: the same cadence
            self.every = max(1, round(self.interval_s / slowest))
        if self.factor > 0 and world > 1:
            self._stragglers(dict(enumerate(seconds)), health, "rank")
        if self.replicas is not None:
            everyone = self.replicas(statistics.fmean(seconds))
            if self.factor > 0 and len(everyone) > 1:
                self._stragglers(everyone, health, "replica")
        return health

    def _stragglers(self, everyone: dict[int, float], health: Health, what: str) -> None:
        """`everyone`: each rank's (or replica's) own work per step, by its number."""
        median = statistics.median(everyone.values())
        for number, seconds in everyone.items():
            ratio = seconds / median if median > 0 else 1.0
            key = (what, number)
            self._streaks[key] = self._streaks.get(key, 0) + 1 if ratio > self.factor else 0
            if self._streaks[key] >= self.windows:
                health.metrics[f"straggler/{what}{number}"] = ratio
            if self._streaks[key] == self.windows:
                health.messages.append(
                    f"{what} {number} is a straggler: its batch fetch + forward takes "
                    f"{ratio:.1f}× the median {what}'s ({seconds * 1e3:.1f} ms vs "
                    f"{median * 1e3:.1f} ms) for {self.windows} reporting windows in a row"
                )

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
