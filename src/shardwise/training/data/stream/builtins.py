"""The streamed data sets a job file names: `data.name = "parquet"`, `"delta"` or `"iceberg"`, with
their arguments in `data.args` (docs/data.md). Each returns `(train, held_out)` sources, like any
data builder; nothing is read until the run starts (`TableSource.open`)."""

from __future__ import annotations

import datetime
import functools
import importlib
import os
from typing import Any

import fsspec
from fsspec.core import split_protocol
from pydantic import NonNegativeInt, PositiveInt

from shardwise.common.imports import import_object
from shardwise.training.data.stream.source import (
    delta_table,
    iceberg_table,
    parquet_files,
    refused_endpoint,
)
from shardwise.training.data.stream.table import TableSource, Transform, next_token
from shardwise.training.data.stream.tensors import Columns

TRANSFORMS: dict[str, Transform] = {"next_token": next_token}
SHUFFLE_ROWS = 65_536


def build_parquet(
    *,
    path: str,
    inputs: str | list[str],
    target: str = "",
    transform: str = "",
    row_transform: str = "",
    shuffle_rows: NonNegativeInt = SHUFFLE_ROWS,
    read_threads: PositiveInt = 8,
    eval_path: str = "",
) -> tuple[TableSource, TableSource | None]:
    """Parquet files: `path` is a file, a directory or a glob, local or an fsspec URL
    (s3://bucket/prefix/); `eval_path` the same for held-out data (none by default)."""
    common = _common(inputs, target, transform, row_transform, shuffle_rows, read_threads)

    def files(at: str) -> TableSource:
        prepare = functools.partial(_filesystem, at)
        return TableSource(lambda: parquet_files(at), where=at, prepare=prepare, **common)

    return files(path), files(eval_path) if eval_path else None


def build_delta(
    *,
    table: str,
    inputs: str | list[str],
    target: str = "",
    version: NonNegativeInt | None = None,
    timestamp: str | datetime.datetime | None = None,
    transform: str = "",
    row_transform: str = "",
    shuffle_rows: NonNegativeInt = SHUFFLE_ROWS,
    read_threads: PositiveInt = 8,
    eval_table: str = "",
) -> tuple[TableSource, TableSource | None]:
    """A Delta Lake table (a path or URL) at `version`, or as of `timestamp` (ISO 8601 text or a
    TOML datetime), or its latest version, which the run then pins (written into its resolved
    config)."""
    if version is not None and timestamp is not None:
        raise ValueError("data.args.version and data.args.timestamp: give one, not both")
    common = _common(inputs, target, transform, row_transform, shuffle_rows, read_threads)
    prepare = functools.partial(_prepared, "deltalake", table)
    train = TableSource(
        lambda: delta_table(table, version=version, timestamp=timestamp),
        pin=lambda snapshot: {"version": snapshot.version["version"], "timestamp": None},
        where=table,
        prepare=prepare,
        **common,
    )
    held_out = (
        TableSource(lambda: delta_table(eval_table), where=eval_table, prepare=prepare, **common)
        if eval_table
        else None
    )
    return train, held_out


def build_iceberg(
    *,
    table: str,
    catalog: dict[str, Any],
    inputs: str | list[str],
    target: str = "",
    snapshot_id: int | None = None,
    transform: str = "",
    row_transform: str = "",
    shuffle_rows: NonNegativeInt = SHUFFLE_ROWS,
    read_threads: PositiveInt = 8,
    eval_table: str = "",
) -> tuple[TableSource, TableSource | None]:
    """An Iceberg table `namespace.name` of `catalog` (pyiceberg's catalog properties, e.g.
    `{type = "sql", uri = "sqlite:///catalog.db", warehouse = "s3://bucket/warehouse"}`) at
    `snapshot_id`, or its current snapshot, which the run then pins."""
    common = _common(inputs, target, transform, row_transform, shuffle_rows, read_threads)
    # the catalog's implementation (SQL: SQLAlchemy, seconds to import on a busy machine)
    kind = {"sql": "pyiceberg.catalog.sql", "rest": "pyiceberg.catalog.rest"}
    prepare = functools.partial(_imported, kind.get(str(catalog.get("type")), "pyiceberg.catalog"))
    train = TableSource(
        lambda: iceberg_table(table, catalog=catalog, snapshot_id=snapshot_id),
        pin=lambda snapshot: {"snapshot_id": snapshot.version["snapshot_id"]},
        where=f"iceberg table {table}",
        prepare=prepare,
        **common,
    )
    held_out = (
        TableSource(
            lambda: iceberg_table(eval_table, catalog=catalog),
            where=f"iceberg table {eval_table}",
            prepare=prepare,
            **common,
        )
        if eval_table
        else None
    )
    return train, held_out


def _common(
    inputs: str | list[str],
    target: str,
    transform: str,
    row_transform: str,
    shuffle_rows: int,
    read_threads: int,
) -> dict[str, Any]:
    names = (inputs,) if isinstance(inputs, str) else tuple(inputs)
    if not names or not all(names):
        raise ValueError("data.args.inputs: name a column (or a list of columns)")
    if not target and transform != "next_token":
        raise ValueError(
            "data.args.target: name the target column (or use transform = 'next_token' for "
            "token sequences, whose target is the next token)"
        )
    return {
        "columns": Columns(names, target),
        "shuffle_rows": shuffle_rows,
        "read_threads": read_threads,
        "transform": _transform(transform, "data.args.transform"),
        "row_transform": _transform(row_transform, "data.args.row_transform"),
    }


def _imported(module: str) -> None:
    importlib.import_module(module)


def _prepared(module: str, table: str) -> None:
    """A table format's library imported, and an S3 endpoint that refuses said at once."""
    _imported(module)
    _reachable(table)


def _filesystem(path: str) -> None:
    """The filesystem class of `path`'s protocol imported (s3fs, and botocore under it), and
    an S3 endpoint that refuses said at once."""
    fsspec.get_filesystem_class(split_protocol(path)[0] or "file")
    _reachable(path)


def _reachable(url: str) -> None:
    """For an S3 URL, the endpoint AWS_ENDPOINT_URL names checked: one that refuses is said at
    once (botocore would retry it for seconds, past the listing's time)."""
    endpoint = os.environ.get("AWS_ENDPOINT_URL", "")
    if split_protocol(url)[0] in ("s3", "s3a") and endpoint:
        refused_endpoint(endpoint, url)


def _transform(name: str, key: str) -> Transform | None:
    if not name:
        return None
    if name in TRANSFORMS:
        return TRANSFORMS[name]
    if ":" not in name:
        raise ValueError(
            f"{key} = '{name}' is neither a built-in ({', '.join(TRANSFORMS)}) nor an import "
            "path like 'package.module:function'"
        )
    found: Transform = import_object(name, key)
    return found
