"""A streamed table as the trainer sees it: `TableSource` is what a job file describes (built
before launch, without reading anything); `Stream` is that source resolved to one pinned
snapshot, which reads blocks of row groups as (inputs, target) tensors.

Transforms (`module:function`, or the built-in `next_token`):
- `transform(inputs, target) -> (inputs, target)` on every micro-batch (batch first);
- `row_transform(inputs, target) -> (inputs, target)` on every row, before batching.
`next_token` takes a column of token sequences of length L + 1 and makes the inputs its first L
tokens and the target its last L (the next token at every position), as language models train.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from torch.utils.data import TensorDataset

from shardwise.training.data.stream.source import (
    REACH_S,
    DataError,
    Snapshot,
    storage_problem,
    within,
)
from shardwise.training.data.stream.tensors import Columns, Parts, widened

Pair = tuple[torch.Tensor, torch.Tensor | None]
Transform = Callable[[torch.Tensor, Any], tuple[torch.Tensor, torch.Tensor]]
OPEN_FILES = 8
"""Parquet files each reading thread keeps open (their footers parsed) for the next block."""
BLOCK_BYTES = 32 * 2**20
"""The most a block reads in one request (uncompressed bytes, as Parquet footers count them)."""
BLOCKS_PER_WINDOW = 4
"""A block holds at most this share of a shuffle window's rows (`shuffle_rows`)."""


def next_token(inputs: torch.Tensor, target: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Token sequences of length L + 1 to (the first L tokens, the next token at each)."""
    del target
    return inputs[..., :-1], inputs[..., 1:]


@dataclass(frozen=True)
class TableSource:
    """A table to stream, as the job file says: how to pin its snapshot, which columns to read
    and how to turn them into samples. Building one reads nothing."""

    resolve: Callable[[], Snapshot]
    """Lists the data and pins its version (called on rank 0, then shared)."""
    columns: Columns
    shuffle_rows: int
    read_threads: int
    transform: Transform | None = None
    row_transform: Transform | None = None
    pin: Callable[[Snapshot], dict[str, Any]] = field(default=lambda snapshot: {})
    """The builder's arguments that pin `snapshot`'s version (Delta's `version`, Iceberg's
    `snapshot_id`): written into the resolved config, so that re-running it reads the same
    data."""
    where: str = ""
    """What the job file names (a path, URL or table), for messages."""
    prepare: Callable[[], None] = field(default=lambda: None)
    """What listing needs that is not storage (importing a table format's library, an object
    store's filesystem): done before the time storage is given starts."""

    def listed(self) -> Snapshot:
        """The data listed and its version pinned now; a `DataError` when the storage has not
        answered within `REACH_S` seconds, or failed (one line naming the data)."""
        self.prepare()
        return within(REACH_S, "listing", self.resolve, self.where)

    def open(self, snapshot: Snapshot | None = None) -> Stream:
        """The stream of `snapshot` (listed now when not given), its columns checked."""
        if snapshot is None:
            snapshot = self.listed()
        self.columns.check(snapshot)
        return Stream(self, snapshot)


@dataclass(frozen=True)
class Block:
    """What one read fetches: consecutive row groups of one file (its rows, in table order)."""

    file: int
    first: int
    """The first row group."""
    groups: int
    rows: int
    bytes: int
    """Uncompressed, as the footer counts them."""


def blocks(snapshot: Snapshot, shuffle_rows: int) -> tuple[Block, ...]:
    """The snapshot's row groups joined into blocks, each read as one request (pyarrow coalesces
    the column chunks of a block's row groups): consecutive row groups of a file up to
    `BLOCK_BYTES`, and up to a quarter of a shuffle window's rows, so that a window still mixes
    rows of several blocks. Where the footers are not known, each row group is a block."""
    most = max(shuffle_rows // BLOCKS_PER_WINDOW, 1) if shuffle_rows else None
    found: list[Block] = []
    for fragment in snapshot.fragments:
        size = (
            snapshot.footers[fragment.file].row_group(fragment.row_group).total_byte_size
            if snapshot.footers
            else None
        )
        last = found[-1] if found else None
        if (
            last is not None
            and size is not None
            and last.file == fragment.file
            and last.first + last.groups == fragment.row_group
            and (most is None or last.rows + fragment.rows <= most)
            and last.bytes + size <= BLOCK_BYTES
        ):
            found[-1] = Block(
                last.file, last.first, last.groups + 1, last.rows + fragment.rows, last.bytes + size
            )
        else:
            found.append(Block(fragment.file, fragment.row_group, 1, fragment.rows, size or 0))
    return tuple(found)


class Stream:
    """One pinned snapshot of a table, read block by block (from any thread). Blocks are the
    fragments the epoch's order shuffles and the loader reads ahead (order.py, loader.py)."""

    def __init__(self, source: TableSource, snapshot: Snapshot) -> None:
        self.source = source
        self.snapshot = snapshot
        self.blocks = blocks(snapshot, source.shuffle_rows)
        self._local = threading.local()

    @property
    def counts(self) -> tuple[int, ...]:
        return tuple(b.rows for b in self.blocks)

    def read(self, index: int) -> Pair:
        """Block `index`'s rows as (inputs, target) tensors, batch first."""
        return self.source.columns.tensors(*self._table(index))

    def read_parts(self, index: int) -> Parts:
        """Block `index`'s rows as (inputs, target), each in pieces that are Arrow's memory
        (`Columns.parts`): what the loader copies straight to where its rows are gathered."""
        return self.source.columns.parts(*self._table(index))

    def locate(self, index: int) -> Callable[[int], str]:
        """Where row `row` of block `index` is: its file, row group and row in that group."""
        return functools.partial(self._locate, self.blocks[index])

    @functools.cached_property
    def dtypes(self) -> tuple[np.dtype, np.dtype | None]:
        """What the inputs and target become in every block (`Columns.dtypes`)."""
        return self.source.columns.dtypes(self.snapshot)

    def _table(self, index: int) -> tuple[pa.Table, Callable[[int], str]]:
        """Block `index`'s columns as read, and where each of its rows is."""
        block = self.blocks[index]
        groups = range(block.first, block.first + block.groups)
        try:
            parquet = self._file(block.file)
            table = parquet.read_row_groups(groups, columns=self.source.columns.read)
        except Exception as e:  # storage that failed: one line naming the file
            url = self.snapshot.files[block.file]
            raise storage_problem(e, f"reading {url}") or e from None
        return table, self.locate(index)

    def _locate(self, block: Block, row: int) -> str:
        """Where row `row` of `block` is: its file, row group and row in that group."""
        url = self.snapshot.files[block.file]
        if not self.snapshot.footers:
            return f"{url}, row groups {block.first} to {block.first + block.groups - 1}, row {row}"
        for group in range(block.first, block.first + block.groups):
            rows = self.snapshot.footers[block.file].row_group(group).num_rows
            if row < rows or group == block.first + block.groups - 1:
                break
            row -= rows
        return f"{url}, row group {group}, row {row}"

    @property
    def by_rows(self) -> bool:
        """Whether a sample depends on its own row alone (no transform of a whole micro-batch
        but `next_token`): then rows are made samples many steps at a time, in one copy."""
        return self.source.row_transform is None and self.source.transform in (None, next_token)

    def batch(self, inputs: torch.Tensor, target: torch.Tensor | None) -> Pair:
        """Rows gathered from blocks (integers as narrow as stored), transformed into a batch
        of samples (integers as int64), each tensor contiguous: a transform's views (as
        `next_token`'s) copied to a GPU would go through an unpinned copy, and a copy from
        unpinned memory makes the host wait for the device."""
        row, whole = self.source.row_transform, self.source.transform
        if whole is next_token and row is None:  # slices: widened after, in the same copy
            inputs, target = next_token(inputs, target)
            return widened(inputs).contiguous(), widened(target).contiguous()
        inputs, target = widened(inputs), None if target is None else widened(target)
        if row is not None:
            pairs = [
                row(inputs[i], None if target is None else target[i]) for i in range(len(inputs))
            ]
            inputs = torch.stack([p[0] for p in pairs])
            target = torch.stack([p[1] for p in pairs])
        if whole is not None:
            inputs, target = whole(inputs, target)
        if target is None:
            raise DataError(
                "the data has no target: name data.args.target, or a transform that makes one "
                "(next_token for token sequences)"
            )
        return inputs.contiguous(), target.contiguous()

    def head(self, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The first `rows` samples (at most a fragment's), as a map-style dataset's items: what
        shapes the model and counts its FLOPs."""
        inputs, target = self.read(0)
        inputs, target = self.batch(inputs[:rows], None if target is None else target[:rows])
        assert target is not None
        return list(zip(inputs, target, strict=True))

    def materialize(self, max_rows: int | None = None) -> TensorDataset:
        """The first `max_rows` rows (all: None) in the snapshot's order, in memory: held-out
        data, read once and evaluated like a map-style split."""
        parts: list[Pair] = []
        held = 0
        for index in range(len(self.blocks)):
            if max_rows is not None and held >= max_rows:
                break
            parts.append(self.read(index))
            held += len(parts[-1][0])
        inputs = torch.cat([p[0] for p in parts])[:max_rows]
        targets = [p[1] for p in parts]
        target = None if targets[0] is None else torch.cat(targets)[:max_rows]  # type: ignore[arg-type]
        x, y = self.batch(inputs, target)
        assert y is not None
        return TensorDataset(x, y)

    def _file(self, file: int) -> pq.ParquetFile:
        """File `file`, opened by this thread (a ParquetFile is not shared between threads); the
        last few stay open, so the next block of a file costs no footer."""
        opened: OrderedDict[int, pq.ParquetFile] = (
            getattr(self._local, "files", None) or OrderedDict()
        )
        self._local.files = opened
        if file in opened:
            opened.move_to_end(file)
            return opened[file]
        fs, path = url_to_fs(self.snapshot.files[file])
        footer = self.snapshot.footers[file] if self.snapshot.footers else None
        if isinstance(fs, LocalFileSystem):  # Arrow's own reads: no Python file in between
            parquet = pq.ParquetFile(path, metadata=footer, memory_map=True)
        elif footer is not None:  # known footer and size: a block is one ranged read
            handle = fs.open(path, "rb", cache_type="none", size=self.snapshot.sizes[file])
            parquet = pq.ParquetFile(handle, metadata=footer, pre_buffer=True)
        else:
            parquet = pq.ParquetFile(fs.open(path, "rb"))
        opened[file] = parquet
        if len(opened) > OPEN_FILES:
            opened.popitem(last=False)[1].close()
        return parquet
