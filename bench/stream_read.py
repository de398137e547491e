"""Samples/s of shardwise's streaming reader (data/stream/) against pyarrow's own dataset scan of
the same Parquet files in the same run: local files by default, or (`--s3`) an S3-compatible
server on loopback (moto, in a process of its own).

Both read the same files (tokenised text: a fixed-size list of 129 int16 tokens per row, as
examples/make_tables.py writes) through the same filesystem, with the same number of threads
(`--threads`: shardwise's `read_threads`; pyarrow's I/O pool, `use_threads`) and the same batch
size, and turn every batch into what a training step takes: inputs (the first 128 tokens) and
targets (the next token at each), contiguous int64 tensors. shardwise also shuffles (a window
of `shuffle_rows`) and plans a global order; pyarrow reads in file order. The default table
(524,288 rows) is eight of shardwise's windows: a smaller one is read mostly before the timing
starts, which would flatter it (refused). Nothing sets the threads
a user does not: torch and OpenMP run as they do by default (`--one-thread` for one each).

Steady state: each contender is opened and gives its first batch outside the timing (imports,
listing, footers, the first block), then the rest of an epoch is timed. Contenders alternate;
the medians are printed with the ratio.

    python bench/stream_read.py                        # 32 files × 8 row groups × 2,048 rows
    python bench/stream_read.py --files 4 --repeats 3
    python bench/stream_read.py --s3
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
import torch
from fsspec.implementations.local import LocalFileSystem

sys.path.insert(0, str(Path(__file__).resolve().parent))

from local_s3 import local_s3

from shardwise.training.data.stream.builtins import SHUFFLE_ROWS

SEQ = 129
READ_AHEAD = 3
"""Windows shardwise reads before its first batch: that one and two ahead (loader.py)."""
STEADY_WINDOWS = 8
"""The fewest windows a table holds for its epoch to be mostly read in the timing."""


def write(fs, prefix: str, files: int, groups: int, rows: int) -> int:
    rng = np.random.default_rng(0)
    for index in range(files):
        tokens = rng.integers(0, 256, size=(groups * rows, SEQ), dtype=np.int16)
        column = pa.FixedSizeListArray.from_arrays(pa.array(tokens.reshape(-1)), SEQ)
        with fs.open(f"{prefix}/part-{index:04d}.parquet", "wb") as f:
            pq.write_table(pa.table({"tokens": column}), f, row_group_size=rows)
    return files * groups * rows


def read_shardwise(url: str, batch: int, threads: int) -> tuple[int, float]:
    """Rows read and seconds taken after the first batch."""
    from shardwise.training.data.stream.builtins import build_parquet
    from shardwise.training.data.stream.loader import StreamLoader

    train, _ = build_parquet(
        path=url, inputs="tokens", transform="next_token", read_threads=threads
    )
    loader = StreamLoader(
        train.open(), global_batch=batch, micro_batch=batch, dp_rank=0, dp_size=1, seed=0
    )
    loader.next_step()  # the first block: outside the timing
    began, seen = time.perf_counter(), 0
    for _ in range(loader.steps_per_epoch - 1):
        ((inputs, _target),) = loader.next_step()
        seen += len(inputs)
    elapsed = time.perf_counter() - began
    loader.close()
    return seen, elapsed


def read_pyarrow(url: str, fs, batch: int, threads: int) -> tuple[int, float]:
    pa.set_io_thread_count(threads)
    path = url.removeprefix("s3://") if fs is not None else url
    dataset = ds.dataset(path, filesystem=fs, format="parquet")
    batches = iter(dataset.to_batches(columns=["tokens"], batch_size=batch, use_threads=True))
    _tensor(next(batches))  # the first batch: outside the timing
    began, seen = time.perf_counter(), 0
    for record in batches:
        seen += len(_tensor(record))
    return seen, time.perf_counter() - began


def _tensor(record: pa.RecordBatch) -> torch.Tensor:
    """The batch a training step takes, as shardwise's loader gives it: the first 128 tokens
    and the next token at each, contiguous int64 tensors (what a copy to a GPU wants)."""
    tokens = record.column(0).flatten().to_numpy(zero_copy_only=False).reshape(-1, SEQ)
    inputs = torch.from_numpy(tokens[:, :-1].astype(np.int64, order="C"))
    target = torch.from_numpy(tokens[:, 1:].astype(np.int64, order="C"))
    assert target.is_contiguous()
    return inputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--files", type=int, default=32)
    parser.add_argument("--groups", type=int, default=8, help="row groups per file")
    parser.add_argument("--rows", type=int, default=2048, help="rows per row group")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--s3", action="store_true", help="from a local S3 server, not files")
    parser.add_argument("--one-thread", action="store_true", help="torch and OpenMP: one each")
    args = parser.parse_args()
    windows = args.files * args.groups * args.rows / SHUFFLE_ROWS
    if windows < STEADY_WINDOWS:
        fewest = -(-STEADY_WINDOWS * SHUFFLE_ROWS // (args.groups * args.rows))
        parser.error(
            f"{args.files} files hold {windows:.1f} shuffle windows of {SHUFFLE_ROWS:,} rows: "
            f"shardwise reads the first {READ_AHEAD} before the timing starts, so steady state "
            f"needs at least {STEADY_WINDOWS} (--files {fewest} or more)"
        )
    if args.one_thread:
        torch.set_num_threads(1)
    with contextlib.ExitStack() as stack:
        if args.s3:
            fs = stack.enter_context(local_s3())
            rows = write(fs, "bench/tokens", args.files, args.groups, args.rows)
            url, where = "s3://bench/tokens/", "a local S3 server"
        else:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "tokens"
            fs = LocalFileSystem(auto_mkdir=True)
            rows = write(fs, str(root), args.files, args.groups, args.rows)
            url, where, fs = str(root), "local disk", None
        print(
            f"{args.files} files × {args.groups} row groups × {args.rows} rows = {rows:,} rows "
            f"on {where}; batch {args.batch}, {args.threads} reading threads, torch "
            f"{torch.get_num_threads()} threads"
        )
        rates: dict[str, list[float]] = {"shardwise": [], "pyarrow": []}
        for _ in range(args.repeats):
            for name in rates:
                seen, seconds = (
                    read_shardwise(url, args.batch, args.threads)
                    if name == "shardwise"
                    else read_pyarrow(url, fs, args.batch, args.threads)
                )
                rates[name].append(seen / seconds)
        for name, found in rates.items():
            print(
                f"{name:>10}: {statistics.median(found):>12,.0f} samples/s "
                f"(min {min(found):,.0f}, max {max(found):,.0f})"
            )
        ratio = statistics.median(rates["shardwise"]) / statistics.median(rates["pyarrow"])
        print(f"shardwise / pyarrow: {ratio:.2f}x (target >= 0.8x)")


if __name__ == "__main__":
    main()
