"""Samples/s of shardwise's streaming reader (data/stream/) from an S3-compatible server on
loopback (moto), against pyarrow's own dataset scan of the same files in the same run.

Both read the same Parquet files (tokenised text: a fixed-size list of 129 int16 tokens per row,
as examples/make_tables.py writes) through the same fsspec S3 filesystem, with the same number of
threads (`--threads`: shardwise's `read_threads`; pyarrow's I/O thread pool, `use_threads`) and the
same batch size, and turn every batch into a torch tensor. shardwise also shuffles (a window of
`shuffle_rows`) and plans a global order; pyarrow reads in file order. Each contender reads the
whole table once per repeat; contenders alternate, and the medians are printed with the ratio.

    python bench/stream_read.py                       # 8 files × 8 row groups × 2,048 rows
    python bench/stream_read.py --files 4 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from local_s3 import local_s3

SEQ = 129


def write(fs, prefix: str, files: int, groups: int, rows: int) -> int:
    rng = np.random.default_rng(0)
    for index in range(files):
        tokens = rng.integers(0, 256, size=(groups * rows, SEQ), dtype=np.int16)
        column = pa.FixedSizeListArray.from_arrays(pa.array(tokens.reshape(-1)), SEQ)
        with fs.open(f"{prefix}/part-{index:04d}.parquet", "wb") as f:
            pq.write_table(pa.table({"tokens": column}), f, row_group_size=rows)
    return files * groups * rows


def read_shardwise(url: str, batch: int, threads: int) -> int:
    from shardwise.training.data.stream.builtins import build_parquet
    from shardwise.training.data.stream.loader import StreamLoader

    train, _ = build_parquet(
        path=url, inputs="tokens", transform="next_token", read_threads=threads
    )
    loader = StreamLoader(
        train.open(), global_batch=batch, micro_batch=batch, dp_rank=0, dp_size=1, seed=0
    )
    seen = 0
    for _ in range(loader.steps_per_epoch):
        ((inputs, _target),) = loader.next_step()
        seen += len(inputs)
    loader.close()
    return seen


def read_pyarrow(url: str, fs, batch: int, threads: int) -> int:
    pa.set_io_thread_count(threads)
    dataset = ds.dataset(url.removeprefix("s3://"), filesystem=fs, format="parquet")
    seen = 0
    for record in dataset.to_batches(columns=["tokens"], batch_size=batch, use_threads=True):
        column = record.column(0)
        values = column.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
        inputs = torch.from_numpy(values).reshape(-1, SEQ)[:, :-1]
        seen += len(inputs)
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--groups", type=int, default=8, help="row groups per file")
    parser.add_argument("--rows", type=int, default=2048, help="rows per row group")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    with local_s3() as fs:
        rows = write(fs, "bench/tokens", args.files, args.groups, args.rows)
        url = "s3://bench/tokens/"
        size = sum(fs.du("bench/tokens", total=False).values()) / 2**20
        print(
            f"{args.files} files × {args.groups} row groups × {args.rows} rows = {rows:,} rows "
            f"({size:.0f} MiB) on a local S3 server; batch {args.batch}, {args.threads} threads"
        )
        times: dict[str, list[float]] = {"shardwise": [], "pyarrow": []}
        for _ in range(args.repeats):
            for name in times:
                began = time.perf_counter()
                seen = (
                    read_shardwise(url, args.batch, args.threads)
                    if name == "shardwise"
                    else read_pyarrow(url, fs, args.batch, args.threads)
                )
                times[name].append(seen / (time.perf_counter() - began))
        for name, rates in times.items():
            print(
                f"{name:>10}: {statistics.median(rates):>10,.0f} samples/s "
                f"(min {min(rates):,.0f}, max {max(rates):,.0f})"
            )
        ratio = statistics.median(times["shardwise"]) / statistics.median(times["pyarrow"])
        print(f"shardwise / pyarrow: {ratio:.2f}x (target >= 0.8x)")


if __name__ == "__main__":
    main()
