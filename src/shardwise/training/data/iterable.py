"""A user's own `torch.utils.data.IterableDataset`, read through torchdata's `StatefulDataLoader`.

Sharding is the dataset's: a builder that takes `dp_rank` and `dp_size` keyword arguments is
given this rank's data-parallel position (job_names.build_datasets), and its dataset yields this
rank's share; a builder that does not take them gets the same dataset on every rank, which then
yields the same samples on every rank (said at start).

Every step takes `global_batch / dp` samples on every rank. When a rank's iterator ends, that rank
starts the next epoch at once (the loader iterates the dataset again), so ranks never wait for one
another; a dataset whose ranks yield different counts drifts between epochs, which an infinite
dataset avoids.

Exact resume: the checkpoint holds each rank's loader state (`StatefulDataLoader.state_dict`,
which holds the dataset's own `state_dict` when it has one, in the workers as well), under the
rank's own key. A dataset without `state_dict`/`load_state_dict` is restarted from its beginning
on resume (said at start): the run goes on, but not on the samples it would have read. Resume is
on the same number of data-parallel ranks.

torchdata 0.11 (the newest) predates torch 2.13; `StatefulDataLoader` was checked with it (the
tests resume bitwise through it) and it is used for this protocol alone: shardwise's own loaders
(sampling.py, stream/) keep their position themselves, which also resumes on other rank counts.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

from torch.utils.data import IterableDataset, default_collate

from shardwise.common.errors import ConfigError


def stateful(dataset: IterableDataset) -> bool:
    return callable(getattr(dataset, "state_dict", None)) and callable(
        getattr(dataset, "load_state_dict", None)
    )


def head(dataset: IterableDataset, count: int) -> list[Any]:
    """The first `count` items, from an iterator of their own; a dataset that keeps its own
    position (`state_dict`) is put back where it was."""
    before = dataset.state_dict() if stateful(dataset) else None  # type: ignore[attr-defined]
    items = []
    for item in dataset:
        items.append(item)
        if len(items) == count:
            break
    if before is not None:
        dataset.load_state_dict(before)  # type: ignore[attr-defined]
    if not items:
        raise ConfigError("the training dataset (an IterableDataset) yields nothing")
    return items


class IterableLoader:
    """Yields, for each optimizer step, this rank's list of collated micro-batches."""

    def __init__(
        self,
        dataset: IterableDataset,
        *,
        micro_batch: int,
        per_rank: int,
        num_workers: int,
        dp_rank: int,
        pin_memory: bool = False,
    ) -> None:
        with warnings.catch_warnings():  # torchdata 0.11 imports a name torch 2.13 deprecates
            warnings.simplefilter("ignore")
            from torchdata.stateful_dataloader import StatefulDataLoader

            self.loader = StatefulDataLoader(
                dataset,
                batch_size=micro_batch,
                num_workers=num_workers,
                collate_fn=default_collate,
                pin_memory=pin_memory,
                drop_last=True,
            )
        self.micro_per_step = per_rank // micro_batch
        self.key = f"rank{dp_rank}"
        self.epoch = 0
        self._iter: Iterator[Any] | None = None
        self._fresh = False

    def next_step(self) -> list[Any]:
        batches: list[Any] = []
        while len(batches) < self.micro_per_step:
            if self._iter is None:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # (set_vital: see __init__)
                    self._iter = iter(self.loader)
                self._fresh = True
            try:
                batches.append(next(self._iter))
                self._fresh = False
            except StopIteration:
                if self._fresh:
                    raise ConfigError(
                        f"the training dataset yields fewer than train.micro_batch "
                        f"({self.loader.batch_size}) samples on data-parallel {self.key}"
                    ) from None
                self._iter = None
                self.epoch += 1
        return batches

    def state_dict(self) -> dict[str, Any]:
        return {self.key: {"loader": self.loader.state_dict(), "epoch": self.epoch}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = state[self.key]
        self.loader.load_state_dict(mine["loader"])
        self.epoch = int(mine["epoch"])
        self._iter = None

    def close(self) -> None:
        self._iter = None
