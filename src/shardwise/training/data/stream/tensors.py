"""Which columns become a sample's inputs and target, and how a column becomes a tensor.

A column is a tensor when its values are numbers (integers: int64; floating point: float32;
booleans: float32 0/1), or lists of numbers of one length (a fixed-size list, or a list whose
rows all have the same length): an image's pixels, a sequence's token ids. Several input columns
of single numbers are stacked into one float32 feature vector per row. Anything else (strings,
structs, maps, lists of different lengths, nulls) is refused, naming the column and what to do.
"""

from __future__ import annotations

import functools
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
        written without statistics) is named when its row group is read (`parts`)."""
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
        first = {name: snapshot.schema.field(name).type for name in self.read}
        for url, footer, schema in zip(
            snapshot.files, snapshot.footers, snapshot.schemas, strict=False
        ):
            self._check_file(url, footer, schema, first)

    def _check_file(
        self, url: str, footer: pq.FileMetaData, schema: pa.Schema, first: dict[str, pa.DataType]
    ) -> None:
        """One file's types (tensors of one kind in every file) and counted missing values."""
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

    def dtypes(self, snapshot: Snapshot) -> tuple[np.dtype, np.dtype | None]:
        """What the inputs and the target become (`parts`) in every file: the widest of the
        files' (integers as narrow as the widest file stores them), so that a window holds
        blocks of every file in one array."""

        def widest(name: str) -> np.dtype:
            files = snapshot.schemas or (snapshot.schema,)
            kinds = {schema.field(name).type for schema in files}
            return np.result_type(*(_dtype(_leaf(kind)) for kind in kinds))

        inputs = widest(self.inputs[0]) if len(self.inputs) == 1 else np.dtype(np.float32)
        return inputs, widest(self.target) if self.target else None

    def parts(self, table: pa.Table, locate: Callable[[int], str]) -> Parts:
        """The inputs and target of every row of `table` (a block), in pieces (`to_parts`);
        `locate(row)` says where a row of it is (file, row group, row), for what reading it
        finds wrong."""
        if len(self.inputs) == 1:
            inputs = to_parts(table.column(self.inputs[0]), self.inputs[0], locate)
        else:  # single numbers, stacked as features
            columns = [joined(to_parts(table.column(n), n, locate)) for n in self.inputs]
            inputs = [np.stack(columns, axis=1).astype(np.float32, copy=False)]
        target = to_parts(table.column(self.target), self.target, locate) if self.target else None
        return inputs, target

    def tensors(
        self, table: pa.Table, locate: Callable[[int], str]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`parts`, each side joined into one tensor of its own memory."""
        inputs, target = self.parts(table, locate)
        return (
            torch.from_numpy(joined(inputs)),
            None if target is None else torch.from_numpy(joined(target)),
        )


Parts = tuple[list[np.ndarray], list[np.ndarray] | None]
"""A block's inputs and target (None: a transform makes it), each in pieces (`to_parts`)."""
NARROW_INTEGERS = tuple(np.dtype(t) for t in (np.int8, np.uint8, np.int16, np.int32, np.int64))
"""The integer widths a block keeps as read (the ones torch gathers); others become int64."""


def to_parts(column: pa.ChunkedArray, name: str, locate: Callable[[int], str]) -> list[np.ndarray]:
    """A column's rows as arrays of shape (rows, *value shape), one per Arrow chunk (one or
    several row groups), each Arrow's own memory where it can be (read-only: nothing is
    copied before the rows reach where they are gathered from)."""
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    parts: list[np.ndarray] = []
    first = 0
    for chunk in chunks:
        if len(chunk) or not parts:
            part = _array(chunk, name, functools.partial(_shifted, locate, first))
            if parts and part.shape[1:] != parts[0].shape[1:]:
                raise DataError(lengths_differ(name, parts[0], part, locate(first)))
            parts.append(part)
        first += len(chunk)
    return parts


def joined(parts: list[np.ndarray]) -> np.ndarray:
    """Pieces as one array of its own (writable) memory."""
    return np.concatenate(parts) if len(parts) > 1 else np.array(parts[0], copy=True)


def lengths_differ(name: str, before: np.ndarray, here: np.ndarray, where: str) -> str:
    def shape(a: np.ndarray) -> str:
        return " x ".join(map(str, a.shape[1:])) or "single numbers"

    return (
        f"column '{name}' holds lists of length {shape(here)} from {where} on but "
        f"{shape(before)} before; pad or cut them to one length (or write a fixed-size list)"
    )


def _array(array: pa.Array, name: str, locate: Callable[[int], str]) -> np.ndarray:
    """One chunk of a column as an array of shape (rows, *value shape)."""
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
    wanted = _dtype(array.type)
    if numbers.dtype != wanted:
        numbers = numbers.astype(wanted)
    shaped: np.ndarray = numbers.reshape(-1, *shape)
    return shaped


def _shifted(locate: Callable[[int], str], first: int, row: int) -> str:
    return locate(first + row)


def _dtype(leaf: pa.DataType) -> np.dtype:
    """What a column's numbers become: integers as narrow as stored (token ids are often
    int16: a step gathers its rows in that width, and `widened` makes the batch int64) where
    torch has the width, else int64; floating point and booleans float32."""
    if pa.types.is_integer(leaf):
        stored = np.dtype(leaf.to_pandas_dtype())
        return stored if stored in NARROW_INTEGERS else np.dtype(np.int64)
    return np.dtype(np.float32)


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
