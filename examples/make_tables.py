"""Write the tables the streaming examples train on, as a data pipeline upstream would:

- `<out>/tokens/` and `<out>/tokens-eval/`: tokenised text as Parquet shards, one row per
  sequence of 129 byte tokens (a fixed-size list column `tokens`), from the Python standard
  library's sources; examples/gpt-parquet.toml trains the GPT on them;
- `<out>/digits-delta/`: a Delta Lake table of the handwritten digits (`image`: 1×8×8 floats as
  nested fixed-size lists, `label`), written in two commits (versions 0 and 1), and
  `<out>/digits-delta-eval/` its held-out split; examples/digits-delta.toml trains the CNN on it.

    python examples/make_tables.py            # into runs/data
    python examples/make_tables.py --out s3://bucket/data   # any fsspec URL (Delta: delta-rs's)
    python examples/make_tables.py --tables tokens          # the token shards only
"""

from __future__ import annotations

import argparse

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.core import url_to_fs

SEQ = 129  # 128 inputs and the next token of each


def token_shards(out: str, *, shards: int = 8, eval_shards: int = 1) -> None:
    from shardwise.training.data.text import stdlib_corpus

    corpus = np.frombuffer(stdlib_corpus(), dtype=np.uint8)
    sequences = corpus[: len(corpus) // SEQ * SEQ].reshape(-1, SEQ).astype(np.int16)
    parts = np.array_split(sequences, shards + eval_shards)
    fs, root = url_to_fs(out)
    for index, part in enumerate(parts):
        folder = "tokens" if index < shards else "tokens-eval"
        tokens = pa.FixedSizeListArray.from_arrays(pa.array(part.reshape(-1)), SEQ)
        fs.makedirs(f"{root}/{folder}", exist_ok=True)
        with fs.open(f"{root}/{folder}/part-{index:05d}.parquet", "wb") as f:
            pq.write_table(pa.table({"tokens": tokens}), f, row_group_size=1024)
    print(f"wrote {len(sequences):,} token sequences of {SEQ} to {out}/tokens and tokens-eval")


def digits_delta(out: str) -> None:
    from deltalake import write_deltalake

    from shardwise.training.data.digits import build_digits

    train, held_out = build_digits()
    for name, split in (("digits-delta", train), ("digits-delta-eval", held_out)):
        images = np.stack([split[i][0].numpy() for i in range(len(split))]).astype(np.float32)
        labels = np.array([int(split[i][1]) for i in range(len(split))], dtype=np.int64)
        image = pa.array(images.reshape(-1))
        for size in (8, 8, 1):  # width, height, channels: a nested fixed-size list
            image = pa.FixedSizeListArray.from_arrays(image, size)
        table = pa.table({"image": image, "label": labels})
        half = len(table) // 2
        write_deltalake(f"{out}/{name}", table.slice(0, half), mode="overwrite")
        write_deltalake(f"{out}/{name}", table.slice(half), mode="append")
    print(f"wrote the digits as Delta tables {out}/digits-delta (versions 0, 1) and -eval")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/data", help="a directory or fsspec URL")
    tables = ["tokens", "digits-delta"]
    parser.add_argument("--tables", nargs="+", choices=tables, default=tables)
    args = parser.parse_args()
    if "tokens" in args.tables:
        token_shards(args.out)
    if "digits-delta" in args.tables:
        digits_delta(args.out)


if __name__ == "__main__":
    main()
