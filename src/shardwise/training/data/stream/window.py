"""A shuffle window's rows that one data-parallel rank reads, in one array per side (inputs,
target), written in place by the reading threads.

A rank gives each fragment it reads of a window a place when it asks for it: the rows after the
fragments it asked for before. A reading thread copies the fragment's rows (Arrow's memory,
`Columns.parts`) straight there, the one copy they take before a step's rows are gathered from
the window (loader.py); nothing is joined. An array spans the whole window (a rank does not
know its share of a window before it has planned every step of it) but is filled from its
start with the rank's share only: memory never written is never given to the process. A window
let go gives its arrays to the next (`Spare`), which writes over the same memory: fresh memory
costs the kernel a page fault and a page of zeros each, as much as the copy itself.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import torch

from shardwise.training.data.stream.source import DataError
from shardwise.training.data.stream.table import Pair
from shardwise.training.data.stream.tensors import Parts, lengths_differ

SPARE_ARRAYS = 4
"""Arrays of windows let go that are kept for the next windows (two sides, two windows)."""


class Spare:
    """Arrays of windows let go, for the next windows (taken from any thread)."""

    def __init__(self) -> None:
        self._arrays: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, rows: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """An array of `rows` rows of `shape` and `dtype`: a spare one where one is as large,
        else a new one."""
        with self._lock:
            for i, array in enumerate(self._arrays):
                if array.shape[1:] == shape and array.dtype == dtype and len(array) >= rows:
                    return self._arrays.pop(i)[:rows]
        return np.empty((rows, *shape), dtype)

    def give(self, window: Window) -> None:
        """The arrays of `window`, whose rows are all read and gathered from."""
        with self._lock:
            for array in window.arrays():
                whole = array if array.base is None else array.base
                if isinstance(whole, np.ndarray) and len(self._arrays) < SPARE_ARRAYS:
                    self._arrays.append(whole)


class Window:
    """One window's arrays, made when its first fragment arrives (a list's length is known
    only then), and the fragments written into them from any thread."""

    def __init__(
        self,
        rows: int,
        dtypes: tuple[np.dtype, np.dtype | None],
        names: tuple[str, str],
        spare: Spare,
    ) -> None:
        self.rows = rows
        self.dtypes = dtypes
        self.names = names
        """The columns of each side, for messages."""
        self._spare = spare
        self._sides: list[np.ndarray | None] = [None, None]
        self._lock = threading.Lock()

    def put(self, first: int, block: Parts, locate: Callable[[int], str]) -> None:
        """A fragment's rows, at rows `first` on of the window (`locate(row)`: where row `row`
        of the fragment is, for a list of another length than the window's)."""
        for side, parts in enumerate(block):
            if parts is None:
                continue
            out = self._side(side, parts[0])
            at = first
            for part in parts:
                if part.shape[1:] != out.shape[1:]:
                    where = locate(at - first)
                    raise DataError(lengths_differ(self.names[side], out, part, where))
                np.copyto(out[at : at + len(part)], part, casting="safe")
                at += len(part)

    def tensors(self) -> Pair:
        """The window's rows as tensors (only the fragments written hold rows)."""
        inputs, target = self._sides
        assert inputs is not None, "a window is gathered from once its fragments arrived"
        return torch.from_numpy(inputs), None if target is None else torch.from_numpy(target)

    def arrays(self) -> list[np.ndarray]:
        return [side for side in self._sides if side is not None]

    def _side(self, side: int, part: np.ndarray) -> np.ndarray:
        with self._lock:
            made = self._sides[side]
            if made is None:
                dtype = self.dtypes[side]
                assert dtype is not None
                made = self._spare.take(self.rows, part.shape[1:], dtype)
                self._sides[side] = made
            return made
