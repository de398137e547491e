"""Stragglers: a rank that is consistently slower than the others slows every synchronous step.

What is compared is each rank's own work — fetching its batch and running forward — measured
before the first collective that would make it wait for the others (under data parallelism the
gradient all-reduce happens in backward, where the fast ranks wait for the slow one, so whole step
times are equal by construction). Every reporting window the ranks' means are gathered; a rank
above `factor` × the median for `windows` windows in a row is flagged once, and its ratio is
recorded while it stays slow.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist


class StragglerMonitor:
    def __init__(self, *, factor: float, windows: int, device: torch.device) -> None:
        self.factor, self.windows, self.device = factor, windows, device
        self._seconds: list[float] = []
        self._streaks: dict[int, int] = {}

    def add(self, seconds: float) -> None:
        """This rank's own work in one step (batch fetch + forward)."""
        self._seconds.append(seconds)

    def check(self) -> tuple[dict[str, float], list[str]]:
        """Collective (every rank calls it at the same steps): per-rank metrics and the messages
        for ranks that just became stragglers; both are meaningful on rank 0 only."""
        mine = torch.tensor([statistics.fmean(self._seconds) if self._seconds else 0.0])
        self._seconds.clear()
        if self.factor <= 0 or dist.get_world_size() < 2:
            return {}, []
        gathered = torch.empty(dist.get_world_size(), dtype=mine.dtype, device=self.device)
        dist.all_gather_into_tensor(gathered, mine.to(self.device))
        everyone = gathered.cpu().tolist()
        median = statistics.median(everyone)
        metrics: dict[str, float] = {}
        messages = []
        for rank, seconds in enumerate(everyone):
            ratio = seconds / median if median > 0 else 1.0
            slow = ratio > self.factor
            self._streaks[rank] = self._streaks.get(rank, 0) + 1 if slow else 0
            if self._streaks[rank] >= self.windows:
                metrics[f"straggler/rank{rank}"] = ratio
            if self._streaks[rank] == self.windows:
                messages.append(
                    f"rank {rank} is a straggler: its batch fetch + forward takes {ratio:.1f}× "
                    f"the median rank's ({seconds * 1e3:.1f} ms vs {median * 1e3:.1f} ms) for "
                    f"{self.windows} reporting windows in a row"
                )
        return metrics, messages
