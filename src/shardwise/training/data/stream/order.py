"""The order a streamed table's rows are trained in: a function of the seed and the epoch only.

The table is read in fragments (blocks of a Parquet file's row groups: table.py), numbered in the
snapshot's order; a row's sample id is its position in that order (the rows of fragment 0, then
of fragment 1, …).

Each epoch:
1. the fragments are shuffled (seeded by seed and epoch) and grouped, in that order, into windows
   of at least `shuffle_rows` rows (the last window takes what is left);
2. each window's rows are shuffled among themselves (seeded by seed, epoch and window): a
   shuffle buffer whose contents and draws are fixed in advance, so that the epoch's sequence of
   sample ids is known without reading anything;
3. step k trains on positions [k·G, (k+1)·G) of that sequence (G = the global batch); the last
   `rows % G` rows of the epoch are left out (a different few each epoch, since the order
   changes), so every step has G samples and every rank the same number of steps.

Which rank reads which of a step's G samples is the only thing that depends on the number of
data-parallel ranks: the step's ids are sorted and rank r takes the r-th contiguous slice. Sorted
ids are grouped by fragment, so a rank reads about 1/dp of the window's fragments, not all of
them; and the step's samples, and so its mean loss, are the same on any number of ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import torch

_MIX = (1_000_003, 998_244_353)


def _generator(*keys: int) -> torch.Generator:
    seed = 0
    for key, mix in zip(keys, (*_MIX, *_MIX), strict=False):
        seed = (seed * mix + key + 1) % 2**63
    return torch.Generator().manual_seed(seed)


@dataclass(eq=False)
class EpochOrder:
    """One epoch's sequence of sample ids over fragments of `counts` rows (see the module). Its
    fields are not changed after it is made; it caches what it computes (starts, windows, the
    latest windows' ids), so it is not a frozen value."""

    counts: tuple[int, ...]
    seed: int
    epoch: int
    shuffle_rows: int
    _window_cache: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @cached_property
    def starts(self) -> torch.Tensor:
        """Each fragment's first sample id."""
        counts = torch.tensor(self.counts, dtype=torch.int64)
        return torch.cumsum(counts, 0) - counts

    @property
    def rows(self) -> int:
        return sum(self.counts)

    @cached_property
    def windows(self) -> list[list[int]]:
        """The fragments of each window, in the epoch's fragment order."""
        order = torch.randperm(len(self.counts), generator=_generator(self.seed, self.epoch))
        windows: list[list[int]] = [[]]
        held = 0
        for fragment in order.tolist():
            if held >= max(self.shuffle_rows, 1) and windows[-1]:
                windows.append([])
                held = 0
            windows[-1].append(fragment)
            held += self.counts[fragment]
        return windows

    @cached_property
    def window_of(self) -> np.ndarray:
        """The window each fragment is in."""
        of = np.zeros(len(self.counts), dtype=np.int64)
        for index, window in enumerate(self.windows):
            of[window] = index
        return of

    @cached_property
    def window_ends(self) -> list[int]:
        """The position in the epoch's sequence just past each window."""
        ends, total = [], 0
        for window in self.windows:
            total += sum(self.counts[f] for f in window)
            ends.append(total)
        return ends

    def window_ids(self, index: int) -> torch.Tensor:
        """Window `index`'s sample ids, shuffled."""
        cached = self._window_cache.get(index)
        if cached is None:
            starts = self.starts.numpy()
            ids = np.concatenate(
                [np.arange(starts[f], starts[f] + self.counts[f]) for f in self.windows[index]]
            )
            if self.shuffle_rows > 0:
                ids = ids[_permutation(len(ids), _generator(self.seed, self.epoch, index))]
            if len(self._window_cache) >= 2:  # a step spans at most a few windows; keep the latest
                self._window_cache.pop(next(iter(self._window_cache)))
            cached = self._window_cache[index] = torch.from_numpy(ids)
        return cached

    def sequence(self, begin: int, end: int) -> torch.Tensor:
        """The sample ids at positions [begin, end) of the epoch's sequence."""
        parts, start = [], 0
        for index, stop in enumerate(self.window_ends):
            if stop > begin and start < end:
                ids = self.window_ids(index).numpy()
                parts.append(ids[max(begin - start, 0) : min(end, stop) - start])
            if stop >= end:
                break
            start = stop
        return torch.from_numpy(np.concatenate(parts) if parts else np.empty(0, dtype=np.int64))

    def step_ids(self, step: int, global_batch: int) -> torch.Tensor:
        """The sample ids of the epoch's step `step` (0-based), sorted."""
        return self.sequence(step * global_batch, (step + 1) * global_batch).sort().values

    def locate(self, ids: torch.Tensor | np.ndarray) -> tuple[Any, Any]:
        """(fragment, row within the fragment) of each sample id, as tensors or arrays as
        `ids` is (numpy does the work: loader.py's note on torch's intra-op threads)."""
        given = ids.numpy() if isinstance(ids, torch.Tensor) else ids
        starts = self.starts.numpy()
        fragment = np.searchsorted(starts, given, side="right") - 1
        row = given - starts[fragment]
        if isinstance(ids, torch.Tensor):
            return torch.from_numpy(fragment), torch.from_numpy(row)
        return fragment, row


def _permutation(n: int, generator: torch.Generator) -> np.ndarray:
    """torch's `randperm` (the same draws on any number of threads), on one thread: it fills
    0..n-1 in parallel first, which wakes torch's intra-op threads, and they then spin for
    milliseconds on the cores the reading threads decode on (numpy moves the rest: loader.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return torch.randperm(n, generator=generator).numpy()
    finally:
        torch.set_num_threads(threads)


def rank_slice(ids: torch.Tensor, dp_rank: int, dp_size: int) -> torch.Tensor:
    """Data-parallel rank `dp_rank`'s contiguous share of a step's sorted ids."""
    per_rank = len(ids) // dp_size
    return ids[dp_rank * per_rank : (dp_rank + 1) * per_rank]
