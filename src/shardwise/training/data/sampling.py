"""Which samples each data-parallel rank reads at each step, and the loaders that fetch them.

Sharding rule. Each epoch is a permutation of the training set drawn from (seed, epoch). A step
takes the next `global_batch` indices of that permutation; data-parallel rank r of n reads the
r-th of n contiguous slices of them (equal, or, where n does not divide the batch, as live
recovery's replicas read it, differing by at most one sample: `chunk`) and splits it into
micro-batches. So the ranks of one step read disjoint
samples, one epoch of steps reads each sample at most once, and the order does not depend on the
number of ranks: a run on 1 process with 4 micro-batches reads exactly what 4 ranks read.

Remainder. An epoch ends when fewer than `global_batch` unread indices are left; those few samples
(`len(dataset) % global_batch`) are skipped in that epoch. The next epoch reshuffles, so a
different few are skipped each time, and every step has the same number of samples (the loss is
then a mean over equal-sized batches, which keeps data parallelism exact).

The position (epoch, offset into the permutation) is the whole state: saving it after a step and
restoring it resumes with the very next sample, whatever the number of ranks.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from shardwise.common.errors import ConfigError

Batch = Any  # whatever the dataset's items collate to, usually (inputs, target)


def enough(rows: int, global_batch: int, what: str) -> None:
    """Refuse data with fewer samples than one step takes."""
    if rows < global_batch:
        raise ConfigError(
            f"{what} has {rows} samples, fewer than train.global_batch ({global_batch}); lower "
            "the global batch or use more data"
        )


class Loader(Protocol):
    """What the training loop reads its steps from: `StepLoader` (map-style data) or a streamed
    table's `StreamLoader` (data/stream/loader.py)."""

    def next_step(self) -> list[Batch]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class GlobalBatchSampler:
    """The indices each data-parallel rank reads, step by step; see the module docstring."""

    def __init__(
        self, num_samples: int, *, global_batch: int, dp_rank: int, dp_size: int, seed: int
    ) -> None:
        enough(num_samples, global_batch, "the training set")
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.span: tuple[int, int] | None = None
        """This rank's slice [first, end) of each step's samples where live recovery placed it
        (`place_span`), instead of its `chunk` as a data-parallel rank."""
        self.epoch = 0
        self.offset = 0
        self._perm: tuple[int, torch.Tensor] | None = None

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch

    def permutation(self, epoch: int) -> torch.Tensor:
        if self._perm is None or self._perm[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = (epoch, torch.randperm(self.num_samples, generator=generator))
        return self._perm[1]

    def epoch_plan(self) -> list[list[int]]:
        """This rank's indices for each remaining step of the current epoch."""
        first, end = self.slice()
        perm = self.permutation(self.epoch)
        plan = []
        for start in range(
            self.offset, self.num_samples - self.global_batch + 1, self.global_batch
        ):
            plan.append(perm[start + first : start + end].tolist())
        return plan

    @property
    def per_rank(self) -> int:
        """The samples this rank reads each step."""
        first, end = self.slice()
        return end - first

    def slice(self) -> tuple[int, int]:
        """This rank's [first, end) of each step's samples."""
        return self.span or chunk(self.global_batch, self.dp_rank, self.dp_size)

    def place(self, dp_rank: int, dp_size: int) -> bool:
        """Read as rank `dp_rank` of `dp_size` from the next step on (live recovery's
        membership changed); whether that is a change."""
        moved = (dp_rank, dp_size, None) != (self.dp_rank, self.dp_size, self.span)
        self.dp_rank, self.dp_size, self.span = dp_rank, dp_size, None
        return moved

    def place_span(self, first: int, end: int) -> bool:
        """Read samples [first, end) of each step from the next step on (live recovery under
        a pipeline: whole micro-batches); whether that is a change."""
        moved = (first, end) != self.span
        self.span = (first, end)
        return moved

    def advance(self) -> None:
        """Mark one step as consumed."""
        self.offset += self.global_batch
        if self.offset + self.global_batch > self.num_samples:
            self.epoch, self.offset = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        if self.offset + self.global_batch > self.num_samples:  # the global batch changed
            self.epoch, self.offset = self.epoch + 1, 0


def chunk(total: int, rank: int, ranks: int, unit: int = 1) -> tuple[int, int]:
    """Rank `rank` of `ranks`'s slice [first, end) of `total` samples: contiguous slices in rank
    order whose sizes differ by at most one `unit` (equal where `ranks` divides `total` /
    `unit`; `unit` divides `total`)."""
    units = total // unit
    return units * rank // ranks * unit, units * (rank + 1) // ranks * unit


class StepLoader:
    """Yields, for each optimizer step, this rank's list of collated micro-batches.

    Fetching goes through a torch DataLoader per epoch (so `num_workers` prefetches), but the
    position only moves when the training loop takes a step, so prefetching never skews resume.
    With `pin_memory` (a CUDA run) batches come in page-locked memory, so that their copies to
    the device (`non_blocking`) do not stall the host: as a step never waits for the device, the
    host fetches and sends the next step's batch while the device still computes this one.
    """

    def __init__(
        self,
        dataset: Dataset,
        sampler: GlobalBatchSampler,
        *,
        micro_batch: int,
        num_workers: int,
        pin_memory: bool = False,
    ) -> None:
        self.dataset = dataset
        self.sampler = sampler
        self.micro_batch = micro_batch
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self._micro: Iterator[Batch] | None = None

    def next_step(self) -> list[Batch]:
        if self._micro is None:
            self._micro = iter(self._epoch_loader())
        count = -(-self.sampler.per_rank // self.micro_batch)  # the last may be smaller
        batches = [next(self._micro) for _ in range(count)]
        epoch = self.sampler.epoch
        self.sampler.advance()
        if self.sampler.epoch != epoch:
            self._micro = None
        return batches

    def _epoch_loader(self) -> DataLoader:
        micro_batches = [
            step[i : i + self.micro_batch]
            for step in self.sampler.epoch_plan()
            for i in range(0, len(step), self.micro_batch)
        ]
        return DataLoader(
            self.dataset,
            batch_sampler=micro_batches,
            num_workers=self.num_workers,
            collate_fn=default_collate,
            pin_memory=self.pin_memory,
            generator=_private_generator(self.sampler.seed, self.sampler.epoch),
        )

    def state_dict(self) -> dict[str, Any]:
        return dict(self.sampler.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
        self._micro = None

    def place(self, dp_rank: int, dp_size: int) -> None:
        """Read as data-parallel rank `dp_rank` of `dp_size` from the next step on."""
        if self.sampler.place(dp_rank, dp_size):
            self._micro = None

    def place_span(self, first: int, end: int) -> None:
        """Read samples [first, end) of each step from the next step on."""
        if self.sampler.place_span(first, end):
            self._micro = None

    def close(self) -> None:
        self._micro = None  # the epoch's DataLoader, and its worker processes


def eval_loader(
    dataset: Dataset, *, dp_rank: int, dp_size: int, batch: int, max_samples: int | None
) -> DataLoader:
    """Held-out samples strided over data-parallel ranks, none dropped and none repeated, so that
    summing counts across ranks gives exact metrics over the whole split."""
    total = len(dataset)  # type: ignore[arg-type]
    if max_samples is not None:
        total = min(total, max_samples)
    mine = list(range(dp_rank, total, dp_size))
    batches = [mine[i : i + batch] for i in range(0, len(mine), batch)]
    return DataLoader(
        dataset,
        batch_sampler=batches,
        collate_fn=default_collate,
        generator=_private_generator(0, 0),
    )


def _private_generator(seed: int, epoch: int) -> torch.Generator:
    """A generator for a DataLoader's worker seeds. Without one, every `iter(loader)` draws from
    the global generator, and a resumed run (which starts its loader at a different step) would
    then draw different dropout masks from the run that never stopped."""
    return torch.Generator().manual_seed(seed * 1_000_003 + epoch + 7)
