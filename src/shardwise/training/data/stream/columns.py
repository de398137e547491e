"""Which columns become a sample's inputs and target, and how a column becomes a tensor.

A column is a tensor when its values are numbers (integers: int64; floating point: float32;
booleans: float32 0/1), or lists of numbers of one length (a fixed-size list, or a list whose
rows all have the same length): an image's pixels, a sequence's token ids. Several input columns
of single numbers are stacked into one float32 feature vector per row. Anything else (strings,
structs, maps, lists of different lengths, nulls) is refused, naming the column and what to do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from shardwise.training.data.stream.source import DataError, Snapshot

NUMBERS = "numbers, or lists of numbers of one length"


@dataclass(frozen=True)
class Columns:
    """The columns a job reads: `inputs` (one column, or several single-number columns stacked
    as features) and `target` (one column; "" when a transform makes it, as `next_token`)."""

    inputs: tuple[str, ...]
    target: str

    @property
    def read(self) -> list[str]:
        return [*self.inputs, *([self.target] if self.target else [])]

    def check(self, snapshot: Snapshot) -> None:
        """Refuse, before anything trains and without reading a row, a column the data does
        not have or whose type cannot be a tensor, in any file, and missing values the files'
        footers count (their row groups' statistics: Delta's and Iceberg's data files are
        Parquet too). What only reading finds (lists of different lengths, a null in a file
        written without statistics) is named when its row group is read (`tensors`)."""
        absent = dict(snapshot.absent)
        names = snapshot.schema.names
        for name in self.read:
            if name in absent:
                raise DataError(f"column '{name}' is {absent[name]}; train on another column")
            if name not in names:
                raise DataError(
                    f"{snapshot.where} has no column '{name}' (it has: {', '.join(names)})"
                )
        if len(self.inputs) > 1:
            for name in self.inputs:
                if _is_list(snapshot.schema.field(name).type):
                    raise DataError(
                        f"column '{name}' holds lists: several input columns are stacked as "
                        "features and must hold single numbers; name one list column as inputs"
                    )
        footers = snapshot.footers or ()
        first = {name: snapshot.schema.field(name).type for name in self.read}
        for url, footer in zip(snapshot.files, footers, strict=False):
            self._check_file(url, footer, first)

    def _check_file(self, url: str, footer: pq.FileMetaData, first: dict[str, pa.DataType]) -> None:
        """One file's types (tensors of one kind in every file) and counted missing values."""
        schema = footer.schema.to_arrow_schema()
        for name in self.read:
            kind = schema.field(name).type
            wrong = _type_problem(kind)
            if wrong:
                raise DataError(
                    f"column '{name}' is {wrong} in {url}; a column read must hold {NUMBERS}"
                )
            if _kind(kind) != _kind(first[name]):
                raise DataError(
                    f"column '{name}' holds {_leaf(kind)} in {url} but {_leaf(first[name])} in "
                    "the first file; write it with one type in every file"
                )
        for group in range(footer.num_row_groups):
            row_group = footer.row_group(group)
            for index in range(row_group.num_columns):
                chunk = row_group.column(index)
                name = chunk.path_in_schema.split(".")[0]
                stats = chunk.statistics
                if name not in self.read or stats is None or not stats.has_null_count:
                    continue
                if stats.null_count:
                    nested = " or empty lists" if "." in chunk.path_in_schema else ""
                    plural = "s" if stats.null_count > 1 else ""
                    raise DataError(
                        f"column '{name}' has {stats.null_count} missing value{plural}{nested} "
                        f"in {url} (row group {group}); fill or drop them before training"
                    )

    def tensors(
        self, table: pa.Table, locate: Callable[[int], str]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The inputs and target of every row of `table` (a block); `locate(row)` says where
        a row of it is (file, row group, row), for what reading it finds wrong."""
        if len(self.inputs) == 1:
            inputs = to_tensor(table.column(self.inputs[0]), self.inputs[0], locate)
        else:
            inputs = torch.stack(
                [to_tensor(table.column(n), n, locate).float() for n in self.inputs], dim=1
            )
        target = to_tensor(table.column(self.target), self.target, locate) if self.target else None
        return inputs, target


NARROW_INTEGERS = tuple(np.dtype(t) for t in (np.int8, np.uint8, np.int16, np.int32, np.int64))
"""The integer widths a fragment keeps as read (the ones torch gathers); others become int64."""


def to_tensor(column: pa.ChunkedArray, name: str, locate: Callable[[int], str]) -> torch.Tensor:
    """A column as a tensor of shape (rows, *value shape)."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if array.null_count:
        first = pc.index(pc.is_null(array), True).as_py()
        raise DataError(
            f"column '{name}' has {array.null_count} missing values ({locate(first)} first); "
            "fill or drop them before training"
        )
    shape: list[int] = []
    per_row = 1  # values of this depth per row (the lists above are all of one length)
    while _is_list(array.type):
        if pa.types.is_fixed_size_list(array.type):
            size = array.type.list_size
        else:
            lengths = pc.list_value_length(array)
            low, high = pc.min(lengths).as_py(), pc.max(lengths).as_py()
            if low != high:
                odd = pc.index(pc.not_equal(lengths, lengths[0]), True).as_py()
                raise DataError(
                    f"column '{name}' holds lists of different lengths ({low} to {high}; "
                    f"{locate(odd // per_row)} first); pad or cut them to one length (or "
                    "write a fixed-size list)"
                )
            size = low or 0
        values = array.flatten()
        per_row *= max(size, 1)
        if values.null_count:
            inner = pc.index(pc.is_null(values), True).as_py()
            raise DataError(
                f"column '{name}' has missing values inside its lists "
                f"({locate(inner // per_row)} first); fill them"
            )
        shape.append(size)
        array = values
    numbers = array.to_numpy(zero_copy_only=False)
    if pa.types.is_integer(array.type):
        # as narrow as stored (token ids are often int16): a step gathers its rows from the
        # fragment in that width, and `widened` makes the batch int64
        if numbers.dtype not in NARROW_INTEGERS:
            numbers = numbers.astype(np.int64)
    else:
        numbers = numbers.astype(np.float32, copy=False)
    return torch.from_numpy(np.require(numbers, requirements=["C", "W"])).reshape(-1, *shape)


def widened(values: torch.Tensor) -> torch.Tensor:
    """Integers as int64, what embeddings and losses take (a contiguous copy, by numpy on this
    thread alone: loader.py says why); floats as they are."""
    if values.is_floating_point() or values.dtype == torch.int64:
        return values
    return torch.from_numpy(values.numpy().astype(np.int64, order="C"))


def _is_list(kind: pa.DataType) -> bool:
    return bool(
        pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)
    )


def _leaf(kind: pa.DataType) -> pa.DataType:
    while _is_list(kind):
        kind = kind.value_type
    return kind


def _kind(kind: pa.DataType) -> str:
    """What a column's values become: integers, floating point, or 0/1 (booleans)."""
    leaf = _leaf(kind)
    return (
        "integer" if pa.types.is_integer(leaf) else "bool" if pa.types.is_boolean(leaf) else "float"
    )


def _type_problem(kind: pa.DataType) -> str | None:
    """Why a column of this type cannot be a tensor, or None."""
    leaf = _leaf(kind)
    if pa.types.is_integer(leaf) or pa.types.is_floating(leaf) or pa.types.is_boolean(leaf):
        return None
    return f"of type {leaf}"
