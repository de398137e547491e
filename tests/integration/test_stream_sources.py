"""Streamed tables where they live: Parquet files on an S3-compatible server (moto, on loopback),
Delta Lake tables written by deltalake (on disk and on that server), Iceberg tables written by
pyiceberg into a SQL catalog on SQLite. Each is read without a converted copy, at the version
asked for, and bad input is one line (a version that does not exist, an empty table, storage
that does not answer: within seconds)."""

from __future__ import annotations

import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from shardwise.training.data.stream.builtins import build_delta, build_iceberg, build_parquet
from shardwise.training.data.stream.loader import StreamLoader
from shardwise.training.data.stream.source import DataError

pytestmark = pytest.mark.slow


def rows(start: int, count: int) -> pa.Table:
    ids = list(range(start, start + count))
    return pa.table({"x": [float(i) for i in ids], "id": ids})


def read_all(source) -> list[int]:
    stream = source.open()
    loader = StreamLoader(stream, global_batch=4, micro_batch=4, dp_rank=0, dp_size=1, seed=0)
    ids = [int(i) for _ in range(loader.steps_per_epoch) for i in loader.next_step()[0][1]]
    loader.close()
    return ids


def test_parquet_files_on_an_object_store_are_read_where_they_are(s3):
    s3.mkdir("data")
    for part in range(3):
        with s3.open(f"data/table/part-{part}.parquet", "wb") as f:
            pq.write_table(rows(10 * part, 10), f, row_group_size=4)
    train, _ = build_parquet(path="s3://data/table/", inputs="x", target="id")
    stream = train.open()
    assert stream.snapshot.files[0] == "s3://data/table/part-0.parquet"
    assert len(stream.snapshot.fragments) == 9 and stream.snapshot.rows == 30
    ids = read_all(train)  # 7 steps of 4: 28 of the 30 rows, each once
    assert len(ids) == len(set(ids)) == 28 and set(ids) <= set(range(30))
    globbed, _ = build_parquet(path="s3://data/table/part-[01].parquet", inputs="x", target="id")
    assert globbed.open().snapshot.rows == 20


def test_storage_that_does_not_answer_is_reported_within_seconds(monkeypatch):
    import socket

    silent = socket.socket()  # accepts connections, never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{silent.getsockname()[1]}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    train, _ = build_parquet(path="s3://nowhere/table/", inputs="x", target="id")
    with pytest.raises(DataError, match="listing s3://nowhere/table/: no answer within 10 s"):
        train.open()
    silent.close()


def test_storage_that_refuses_is_one_line_naming_the_url(monkeypatch):
    """botocore's errors are not OSErrors: a closed port was a 172-line traceback."""
    from helpers import free_port

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing there
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    train, _ = build_parquet(path="s3://lake/parquet/", inputs="x", target="id")
    with pytest.raises(DataError) as refused:
        train.open()
    line = str(refused.value)
    assert "\n" not in line
    assert line.startswith("listing s3://lake/parquet/: the endpoint http://127.0.0.1:")
    assert "(AWS_ENDPOINT_URL) cannot be reached (ConnectionRefusedError" in line


def test_listing_is_timed_without_the_table_formats_imports():
    """The ten seconds storage is given do not pay for importing pyiceberg's SQL catalog
    (SQLAlchemy; 4.6 s of them on a busy machine): the source imports it before the timer."""
    code = (
        "import sys; from shardwise.training.data.stream.builtins import build_iceberg\n"
        "train, _ = build_iceberg(table='a.b', catalog={'type': 'sql', 'uri': 'sqlite://'}, "
        "inputs='x', target='y')\n"
        "assert 'pyiceberg.catalog.sql' not in sys.modules\n"
        "train.prepare(); assert 'pyiceberg.catalog.sql' in sys.modules and 'sqlalchemy' in "
        "sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_delta_table_is_read_at_the_version_asked_for(tmp_path):
    from deltalake import write_deltalake

    table = str(tmp_path / "delta")
    write_deltalake(table, rows(0, 10))
    write_deltalake(table, rows(10, 6), mode="append")
    latest, _ = build_delta(table=table, inputs="x", target="id")
    snapshot = latest.open().snapshot
    assert snapshot.version == {"kind": "delta", "version": 1} and snapshot.rows == 16
    assert latest.pin(snapshot) == {"version": 1, "timestamp": None}
    first, _ = build_delta(table=table, version=0, inputs="x", target="id")
    assert first.open().snapshot.rows == 10
    ids = read_all(first)
    assert len(ids) == len(set(ids)) == 8 and set(ids) <= set(range(10))
    missing, _ = build_delta(table=table, version=7, inputs="x", target="id")
    with pytest.raises(DataError, match="cannot load version 7"):
        missing.open()
    nowhere, _ = build_delta(table=str(tmp_path / "none"), inputs="x", target="id")
    with pytest.raises(DataError, match="no Delta table there"):
        nowhere.open()


def test_a_delta_timestamp_before_the_first_commit_is_refused_and_a_toml_datetime_read(
    tmp_path,
):
    """delta-rs loads version 0 for a moment before the table existed: refused in one line.
    An unquoted TOML datetime is a datetime, and is read as one."""
    import datetime

    from deltalake import DeltaTable, write_deltalake

    table = str(tmp_path / "delta")
    write_deltalake(table, rows(0, 10))
    write_deltalake(table, rows(10, 6), mode="append")
    stamps = [c["timestamp"] for c in DeltaTable(table).history()]
    created = datetime.datetime.fromtimestamp(min(stamps) / 1000, tz=datetime.UTC)
    early, _ = build_delta(
        table=table, timestamp=(created - datetime.timedelta(days=1)).isoformat(),
        inputs="x", target="id",
    )  # fmt: skip
    with pytest.raises(DataError, match=r"no version at .*: its first commit is of"):
        early.open()
    later = created + datetime.timedelta(milliseconds=1)
    for timestamp in (later, later.replace(tzinfo=None)):  # a TOML datetime, with a zone or not
        at, _ = build_delta(table=table, timestamp=timestamp, inputs="x", target="id")
        assert at.open().snapshot.version["version"] in (0, 1)


def test_a_delta_partition_column_is_named_as_one(tmp_path):
    from deltalake import write_deltalake

    table = str(tmp_path / "delta")
    write_deltalake(
        table, rows(0, 10).append_column("day", pa.array([1, 2] * 5)), partition_by=["day"]
    )
    train, _ = build_delta(table=table, inputs="day", target="id")
    with pytest.raises(DataError, match="column 'day' is a partition column of the Delta table"):
        train.open()
    ok, _ = build_delta(table=table, inputs="x", target="id")
    assert ok.open().snapshot.rows == 10


def test_a_delta_table_on_an_object_store(s3):
    import os

    from deltalake import write_deltalake

    s3.mkdir("lake")
    options = {"AWS_ENDPOINT_URL": os.environ["AWS_ENDPOINT_URL"], "AWS_ALLOW_HTTP": "true",
               "AWS_S3_ALLOW_UNSAFE_RENAME": "true", "AWS_REGION": "us-east-1"}  # fmt: skip
    write_deltalake("s3://lake/table", rows(0, 12), storage_options=options)
    train, _ = build_delta(table="s3://lake/table", inputs="x", target="id")
    assert train.open().snapshot.files[0].startswith("s3://lake/table/")
    assert len(read_all(train)) == 12


def iceberg_catalog(tmp_path) -> dict[str, str]:
    return {"type": "sql", "uri": f"sqlite:///{tmp_path / 'catalog.db'}",
            "warehouse": f"file://{tmp_path / 'warehouse'}"}  # fmt: skip


def test_an_iceberg_table_is_read_at_the_snapshot_asked_for(tmp_path):
    from pyiceberg.catalog import load_catalog

    (tmp_path / "warehouse").mkdir()
    properties = iceberg_catalog(tmp_path)
    catalog = load_catalog("default", **properties)
    catalog.create_namespace("shop")
    table = catalog.create_table("shop.sales", schema=rows(0, 1).schema)
    train, _ = build_iceberg(table="shop.sales", catalog=properties, inputs="x", target="id")
    with pytest.raises(DataError, match="the table is empty"):
        train.open()
    table.append(rows(0, 10))
    first = table.current_snapshot().snapshot_id
    table.append(rows(10, 5))
    snapshot = train.open().snapshot
    assert snapshot.rows == 15 and snapshot.version["snapshot_id"] != first
    assert train.pin(snapshot) == {"snapshot_id": snapshot.version["snapshot_id"]}
    pinned, _ = build_iceberg(
        table="shop.sales", catalog=properties, snapshot_id=first, inputs="x", target="id"
    )
    assert pinned.open().snapshot.rows == 10
    assert torch.tensor(read_all(pinned)).unique().numel() == 8
    wrong, _ = build_iceberg(
        table="shop.sales", catalog=properties, snapshot_id=12345, inputs="x", target="id"
    )
    with pytest.raises(DataError, match="no snapshot 12345"):
        wrong.open()
    absent, _ = build_iceberg(table="shop.none", catalog=properties, inputs="x", target="id")
    with pytest.raises(DataError, match="not in the catalog"):
        absent.open()
