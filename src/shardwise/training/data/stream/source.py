"""Where streamed rows come from: Parquet files (a path, a glob or a directory, local or any fsspec
URL), a Delta Lake table (deltalake, at a version or a timestamp) or an Iceberg table (pyiceberg,
at a snapshot). Each resolves to a `Snapshot`: the files, their row groups (the fragments the
reader reads and the order shuffles), the schema, and what identifies this version of the data.

Nothing is converted or copied: the table formats are read for their list of Parquet files at
the version asked for, and the files are read where they are. Object-store credentials and
endpoints come from the usual environment variables (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_ENDPOINT_URL, …), as for checkpoints.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import json
import os
import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from pyarrow import ArrowException

from shardwise.common.errors import first_line

REACH_S = 10.0
"""How long listing the data may take before it is reported unreachable."""
GLOB = set("*?[")
T = TypeVar("T")


class DataError(ValueError):
    """The data cannot be read as asked: one line saying what and how to fix it."""


READ_ERRORS = (DataError, OSError, ArrowException)
"""What reading a table raises for its data: a mistake in the job, storage that does not answer,
a file that is not Parquet. Anything else is a bug, and keeps its traceback."""


def data_problem(error: BaseException) -> str:
    """One of `READ_ERRORS` as the line the user sees."""
    return f"data: {first_line(error)}"


@dataclasses.dataclass(frozen=True)
class Fragment:
    """A unit of reading: one row group of one file."""

    file: int
    """Index into `Snapshot.files`."""
    row_group: int
    rows: int


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """One version of the data, pinned: every rank reads exactly these fragments."""

    kind: str
    """`parquet`, `delta` or `iceberg`."""
    where: str
    """What the job file names: a path, URL, glob, or table."""
    files: tuple[str, ...]
    """Every file, as an fsspec URL or local path."""
    fragments: tuple[Fragment, ...]
    schema: pa.Schema
    version: dict[str, Any]
    """What identifies this version: the Delta version, the Iceberg snapshot id, or for plain
    files a digest of their names, sizes and modification times (and how many there are)."""
    footers: tuple[pq.FileMetaData, ...] = ()
    """Each file's Parquet footer and size, read once: a row group is then one ranged read."""
    sizes: tuple[int, ...] = ()
    absent: tuple[tuple[str, str], ...] = ()
    """Columns not every file holds, each with why: missing from a file (files of one table
    may differ in columns, and in compatible types: a list or a fixed-size list), or a Delta
    partition's, whose value lives in the table's log."""
    schemas: tuple[pa.Schema, ...] = ()
    """Each file's own schema (from its footer), converted once as the files are listed."""

    @functools.cached_property
    def rows(self) -> int:
        """Every row (summed once: the loader asks at every step)."""
        return sum(f.rows for f in self.fragments)

    def describe(self) -> str:
        pinned = ", ".join(f"{k} {v}" for k, v in self.version.items() if k != "kind")
        return (
            f"{self.kind} {self.where} ({pinned}): {len(self.files)} files, "
            f"{len(self.fragments)} row groups, {self.rows:,} rows"
        )


STORAGE_LIBRARIES = frozenset(
    {"botocore", "aiobotocore", "aiohttp", "s3fs", "gcsfs", "adlfs", "urllib3", "requests"}
    | {"deltalake", "pyiceberg"}  # their readers' errors, where the listing asked them
)
"""Libraries whose errors are storage's (an endpoint that refuses, an unknown host, access
denied, no such bucket), whatever class they give them: botocore's are not OSErrors."""


def storage_problem(error: BaseException, where: str) -> DataError | None:
    """A storage library's error as one line naming `where`; None for any other error."""
    if isinstance(error, DataError):
        return None
    library = type(error).__module__.split(".")[0]
    if not isinstance(error, OSError) and library not in STORAGE_LIBRARIES:
        return None
    return DataError(
        f"{where}: {type(error).__name__}: {first_line(error)[:300]}; check the path or URL, "
        "and for object stores the endpoint and credentials (AWS_ENDPOINT_URL, "
        "AWS_ACCESS_KEY_ID, …)"
    )


def refused_endpoint(endpoint: str, where: str) -> None:
    """A DataError where nothing listens at `endpoint` (an http(s) URL): a connection refused
    at once, or a host that does not resolve. One that accepts and stays silent is `within`'s."""
    url = urlsplit(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname or "", port), timeout=REACH_S).close()
    except TimeoutError:
        return  # the listing's own timer says it
    except OSError as e:
        raise DataError(
            f"listing {where}: the endpoint {endpoint} (AWS_ENDPOINT_URL) cannot be reached "
            f"({type(e).__name__}: {first_line(e)}); check it"
        ) from None


def within(seconds: float, what: str, call: Callable[[], T], where: str = "") -> T:
    """`call()`, or a DataError when it has not answered after `seconds` (storage that does not
    answer: a wrong endpoint, a blocked port) rather than a hang; a storage error as one line
    naming `where`. The call goes on in a daemon thread, which never holds the process back."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as e:  # handed to the caller
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True, name="shardwise-data-list")
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise DataError(
            f"{what} {where}".strip() + f": no answer within {seconds:.0f} s; check the path or "
            "URL, and for object stores the endpoint and credentials (AWS_ENDPOINT_URL, "
            "AWS_ACCESS_KEY_ID, …)"
        )
    if "error" in box:
        error = box["error"]
        raise storage_problem(error, f"{what} {where}".strip()) or error
    return box["value"]  # type: ignore[no-any-return]


def parquet_files(path: str) -> Snapshot:
    """Parquet files at `path`: one file, a directory (every `.parquet` file under it) or a glob,
    in name order."""
    fs, root = url_to_fs(path)
    if GLOB & set(root):
        found = fs.glob(root, detail=True)
    elif fs.isdir(root):
        found = {p: i for p, i in fs.find(root, detail=True).items() if p.endswith(".parquet")}
    elif fs.exists(root):
        found = {root: fs.info(root)}
    else:
        raise DataError(f"{path}: no such file or directory")
    infos = {p: i for p, i in sorted(found.items()) if i.get("type") != "directory"}
    if not infos:
        raise DataError(f"{path}: no Parquet files there")
    files = tuple(fs.unstrip_protocol(p) if _remote(path) else p for p in infos)
    listing = [[name, info.get("size"), _mtime(info)] for name, info in infos.items()]
    digest = hashlib.sha256(json.dumps(listing, default=str).encode()).hexdigest()[:16]
    version = {"files": len(files), "digest": digest}
    sizes = tuple(info.get("size") for info in infos.values())
    return _snapshot("parquet", path, files, version, sizes)


def delta_table(
    uri: str, *, version: int | None = None, timestamp: str | datetime.datetime | None = None
) -> Snapshot:
    """A Delta Lake table at `version`, or as of `timestamp` (ISO 8601, or a TOML datetime; UTC
    where it names no zone), or its latest."""
    from deltalake import DeltaTable
    from deltalake.exceptions import TableNotFoundError

    options = _delta_storage_options(uri)
    try:
        table = DeltaTable(uri, version=version, storage_options=options)
        if timestamp is not None:
            table.load_as_version(as_of(timestamp))
    except TableNotFoundError:
        raise DataError(f"{uri}: no Delta table there") from None
    except Exception as e:  # delta-rs's errors for a version or time it does not have
        first = first_line(e)
        asked = f"version {version}" if version is not None else f"timestamp {timestamp}"
        if version is not None or timestamp is not None:
            raise DataError(f"{uri}: cannot load {asked}: {first}") from None
        raise
    if timestamp is not None:
        _check_existed(table, uri, as_of(timestamp))
    partitions = table.metadata().partition_columns
    features = table.protocol().reader_features or []
    if "deletionVectors" in features:
        raise DataError(
            f"{uri}: the table may have deleted rows in deletion vectors, which streaming its "
            "files would read back; purge them (REORG TABLE … APPLY (PURGE)) or write a copy"
        )
    files = tuple(table.file_uris())
    snapshot = _snapshot("delta", uri, files, {"version": table.version()})
    why = "a partition column of the Delta table, whose values its files do not hold"
    return dataclasses.replace(snapshot, absent=(*snapshot.absent, *((c, why) for c in partitions)))


def as_of(timestamp: str | datetime.datetime) -> datetime.datetime:
    """A moment, from ISO 8601 text or a datetime; UTC where it names no zone."""
    try:
        moment = (
            timestamp
            if isinstance(timestamp, datetime.datetime)
            else datetime.datetime.fromisoformat(timestamp)
        )
    except ValueError:
        raise DataError(
            f"data.args.timestamp = {timestamp!r} is not a date and time; write it as ISO 8601 "
            "(2026-01-31T12:00:00Z)"
        ) from None
    return moment if moment.tzinfo else moment.replace(tzinfo=datetime.UTC)


def _check_existed(table: Any, uri: str, moment: datetime.datetime) -> None:
    """delta-rs loads the first version for a moment before the table's first commit: refuse
    it, as there was no table then."""
    if table.version() != 0:
        return
    # the oldest commit's time (delta-rs numbers a history read at version 0 off by one)
    stamps = [c["timestamp"] for c in table.history() if "timestamp" in c]
    if not stamps:
        return
    created = datetime.datetime.fromtimestamp(min(stamps) / 1000, tz=datetime.UTC)
    if moment < created:
        raise DataError(
            f"{uri}: no version at {moment.isoformat()}: its first commit is of "
            f"{created.isoformat()}; give a later data.args.timestamp or a version"
        )


def iceberg_table(
    table: str, *, catalog: dict[str, Any], snapshot_id: int | None = None
) -> Snapshot:
    """An Iceberg table (`namespace.name`) of the catalog `catalog` (pyiceberg's properties:
    `type`, `uri`, `warehouse`, …), at `snapshot_id` or its current snapshot."""
    from pyiceberg.catalog import load_catalog
    from pyiceberg.exceptions import NoSuchTableError

    properties = {k: str(v) for k, v in catalog.items()}
    name = properties.pop("name", "default")
    try:
        loaded = load_catalog(name, **properties).load_table(table)
    except NoSuchTableError:
        raise DataError(f"iceberg table {table}: not in the catalog") from None
    snapshot = (
        loaded.snapshot_by_id(snapshot_id) if snapshot_id is not None else loaded.current_snapshot()
    )
    if snapshot is None:
        if snapshot_id is not None:
            known = [s.snapshot_id for s in loaded.snapshots()]
            raise DataError(
                f"iceberg table {table}: no snapshot {snapshot_id} (it has {known or 'none'})"
            )
        raise DataError(f"iceberg table {table}: the table is empty (no snapshot yet)")
    tasks = list(loaded.scan(snapshot_id=snapshot.snapshot_id).plan_files())
    if any(task.delete_files for task in tasks):
        raise DataError(
            f"iceberg table {table}: snapshot {snapshot.snapshot_id} has delete files, which "
            "streaming its data files would not apply; rewrite the table's data files first"
        )
    files = tuple(task.file.file_path for task in tasks)
    return _snapshot("iceberg", table, files, {"snapshot_id": snapshot.snapshot_id})


def _snapshot(
    kind: str,
    where: str,
    files: tuple[str, ...],
    version: dict[str, Any],
    listed: tuple[int | None, ...] = (),
) -> Snapshot:
    """The row groups of every file, read from the files' footers (in parallel: on an object
    store each is one request where the listing gave the file's size, `listed`, else two)."""
    if not files:
        raise DataError(f"{where}: the table is empty (no data files)")

    def footer(url: str, size: int | None) -> tuple[pq.FileMetaData, int]:
        fs, path = url_to_fs(url)
        try:
            if isinstance(fs, LocalFileSystem):  # Arrow's own read: no Python file between
                return pq.read_metadata(path), size or os.path.getsize(path)
            with fs.open(path, "rb", size=size) as f:
                return pq.ParquetFile(f).metadata, int(f.size)
        except pa.ArrowInvalid as e:
            raise DataError(f"{url}: not a Parquet file ({e})") from None

    # an object store's footers in parallel (each a request's wait); local ones one after
    # another (Arrow reads a small footer faster than threads hand the GIL around: 2,000 files
    # 0.06 s serially, 0.2 s on 16 threads)
    sized = listed or (None,) * len(files)
    if isinstance(url_to_fs(files[0])[0], LocalFileSystem):
        found = list(map(footer, files, sized))
    else:
        with ThreadPoolExecutor(min(16, len(files))) as pool:
            found = list(pool.map(footer, files, sized))
    footers, sizes = zip(*found, strict=True)
    schemas = tuple(meta.schema.to_arrow_schema() for meta in footers)
    schema = schemas[0]
    lacking: dict[str, str] = {}  # a column some file does not have: the first such file
    fragments: list[Fragment] = []
    for index, (url, meta) in enumerate(zip(files, footers, strict=True)):
        names = set(schemas[index].names)
        for name in schema.names:
            if name not in names:
                lacking.setdefault(name, f"missing from {url}")
        fragments.extend(
            Fragment(index, g, meta.row_group(g).num_rows)
            for g in range(meta.num_row_groups)
            if meta.row_group(g).num_rows
        )
    if not fragments:
        raise DataError(f"{where}: the table is empty (its files hold no rows)")
    version = {"kind": kind, **version}
    return Snapshot(
        kind,
        where,
        files,
        tuple(fragments),
        schema,
        version,
        footers,
        sizes,
        tuple(lacking.items()),
        schemas,
    )


def _remote(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def _mtime(info: dict[str, Any]) -> Any:
    for key in ("mtime", "LastModified", "last_modified", "updated", "created"):
        if key in info:
            return info[key]
    return None


def _delta_storage_options(uri: str) -> dict[str, str]:
    """delta-rs (Rust's object_store) reads most AWS variables itself; an http:// endpoint (a
    local S3-compatible server) must also be allowed explicitly."""
    endpoint = os.environ.get("AWS_ENDPOINT_URL", "")
    if uri.startswith("s3") and endpoint.startswith("http://"):
        return {"AWS_ENDPOINT_URL": endpoint, "AWS_ALLOW_HTTP": "true"}
    return {}
