"""Seconds shardwise takes to open a streamed table of many small Parquet files before launch
(list them, read every footer, check every file's column types and the missing values its
row-group statistics count: `TableSource.open`), against pyarrow's own discovery of the same
files with every footer read (`pyarrow.dataset` + `ensure_complete_metadata`), in the same run.

    python bench/stream_check.py                 # 2,000 files of 64 rows on local disk
    python bench/stream_check.py --files 500 --s3

Contenders alternate, after one untimed open each (imports); medians and the ratio printed.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))

from local_s3 import local_s3


def write(fs, prefix: str, files: int, rows: int) -> None:
    rng = np.random.default_rng(0)
    for index in range(files):
        table = pa.table({"x": rng.random(rows), "y": rng.integers(0, 10, rows)})
        with fs.open(f"{prefix}/part-{index:05d}.parquet", "wb") as f:
            pq.write_table(table, f, row_group_size=max(rows // 2, 1))


def open_shardwise(url: str) -> int:
    from shardwise.training.data.stream.builtins import build_parquet

    train, _ = build_parquet(path=url, inputs="x", target="y")
    return len(train.open().snapshot.files)


def open_pyarrow(url: str, fs) -> int:
    dataset = ds.dataset(url.removeprefix("s3://") if fs else url, filesystem=fs, format="parquet")
    fragments = list(dataset.get_fragments())
    for fragment in fragments:
        fragment.ensure_complete_metadata()
    return len(fragments)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--s3", action="store_true")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        if args.s3:
            fs = stack.enter_context(local_s3())
            write(fs, "bench/many", args.files, args.rows)
            url, where = "s3://bench/many/", "a local S3 server"
        else:
            from fsspec.implementations.local import LocalFileSystem

            root = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "many"
            write(LocalFileSystem(auto_mkdir=True), str(root), args.files, args.rows)
            url, where, fs = str(root), "local disk", None
        print(f"{args.files:,} files of {args.rows} rows on {where}")
        contenders = {
            "shardwise": lambda: open_shardwise(url),
            "pyarrow": lambda: open_pyarrow(url, fs),
        }
        for open_ in contenders.values():
            assert open_() == args.files  # untimed: imports
        times: dict[str, list[float]] = {name: [] for name in contenders}
        for _ in range(args.repeats):
            for name, open_ in contenders.items():
                began = time.perf_counter()
                open_()
                times[name].append(time.perf_counter() - began)
        for name, found in times.items():
            print(
                f"{name:>10}: {statistics.median(found):.3f} s "
                f"(min {min(found):.3f}, max {max(found):.3f})"
            )
        ratio = statistics.median(times["shardwise"]) / statistics.median(times["pyarrow"])
        print(f"shardwise / pyarrow: {ratio:.2f}x the time (lower is faster)")


if __name__ == "__main__":
    main()
