"""Byte-level language-modelling data from a real text corpus that every machine has offline: the
Python standard library's own source files."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch
from pydantic import PositiveInt
from torch.utils.data import Dataset


class ByteWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Non-overlapping windows of `seq_len` bytes; the target is the input shifted by one byte."""

    def __init__(self, data: torch.Tensor, seq_len: int) -> None:
        self.data = data
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        start = index * self.seq_len
        chunk = self.data[start : start + self.seq_len + 1].long()
        return chunk[:-1], chunk[1:]


def stdlib_corpus(max_bytes: int | None = None) -> bytes:
    """The top-level modules of this interpreter's standard library, in file-name order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for path in sorted(root.glob("*.py")):
        text = path.read_bytes()
        parts.append(text)
        total += len(text)
        if max_bytes is not None and total >= max_bytes:
            break
    corpus = b"".join(parts)
    return corpus[:max_bytes] if max_bytes is not None else corpus


def build_text(
    *,
    seq_len: PositiveInt = 128,
    eval_fraction: float = 0.05,
    max_bytes: PositiveInt | None = None,
    path: str | None = None,
) -> tuple[ByteWindows, ByteWindows]:
    """Train and held-out windows of a byte corpus: a file at `path`, or the stdlib sources.

    The held-out split is the last `eval_fraction` of the bytes, so no window straddles both.
    """
    if not 0 < eval_fraction < 1:
        raise ValueError(f"data.args.eval_fraction must be between 0 and 1, got {eval_fraction}")
    if path is not None:
        try:
            corpus = Path(path).read_bytes()[:max_bytes]
        except OSError as e:
            raise ValueError(f"data.args.path: cannot read {path}: {e.strerror}") from None
    else:
        corpus = stdlib_corpus(max_bytes)
    data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8)
    split = int(len(data) * (1 - eval_fraction))
    train, held_out = ByteWindows(data[:split], seq_len), ByteWindows(data[split:], seq_len)
    if len(held_out) == 0:
        raise ValueError(
            f"the corpus ({len(data)} bytes) leaves no held-out window of {seq_len} bytes; "
            "raise data.args.eval_fraction or max_bytes"
        )
    return train, held_out
