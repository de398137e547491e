"""The chunk store of a many-models run: `<run_dir>/chunks/`, one directory per finished chunk,
written atomically, with the layout (series, chunk size) and the job that made them; what `--resume`
reuses and the checks that keep it from reusing chunks of another job or other data."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path

import tomli_w

from shardwise.common.errors import ConfigError
from shardwise.common.job_files import flatten, redacted_dump
from shardwise.manymodel.config import (
    ManyModelsConfig,
)
from shardwise.manymodel.run.chunk_result import ChunkResult
from shardwise.manymodel.run.outputs import TABLES

GLOBAL_FILE = "global.parquet"


_MAX_CHUNK = 100
"""Series per chunk at most: a chunk's result and files stay small, and a lost chunk costs
little to redo."""
_CHUNKS_PER_SLOT = 4
"""Chunks each slot takes at least (where there are series enough): the later ones balance the
slots' loads."""


_IGNORED_ON_RESUME = ("runner.", "tracking.", "features.backend", "features.spark_master")
"""Keys a resumed run may change: where and how it runs, not what it computes."""


_CHUNK_NAME = re.compile(r"chunk-([0-9]{6,})")
"""A finished chunk's directory (`write_chunk`); other entries in `chunks/` are not results."""


def finished_chunks(run_dir: Path, config: ManyModelsConfig, resume: bool) -> set[int]:
    """The chunks an earlier run finished, checked against `--resume` and the job it ran."""
    chunk_dir = run_dir / "chunks"
    names = (_CHUNK_NAME.fullmatch(p.name) for p in chunk_dir.glob("chunk-*"))
    marked = {m[0] for m in names if m and (chunk_dir / m[0] / "done").exists()}
    if marked and not resume:
        raise ConfigError(
            f"{run_dir} already has results of an earlier run; pass --resume to finish it, or set "
            "job.name or job.run_dir for a new one"
        )
    # a chunk missing a file since (not as write_chunk leaves one) is run again
    done = {int(name.removeprefix("chunk-")) for name in marked if complete(chunk_dir / name)}
    saved = run_dir / "job.toml"
    if done and saved.exists():
        from shardwise.common.job_files import load_job_file

        try:
            before = flatten(load_job_file(saved, (), ManyModelsConfig))
        except ConfigError as e:  # written by an earlier shardwise, whose settings changed
            raise ConfigError(
                f"--resume: {saved}, the job its chunks were made by, no longer loads ({e}); "
                "they cannot be reused: use a new job.name or job.run_dir"
            ) from None
        now = flatten(config)
        changed = sorted(
            k
            for k in before.keys() | now.keys()
            if before.get(k) != now.get(k) and not k.startswith(_IGNORED_ON_RESUME)
        )
        if changed:
            raise ConfigError(
                f"--resume: {run_dir} was run with a different job ({', '.join(changed[:3])} "
                "changed); undo the change, or use a new job.name or job.run_dir"
            )
    return done


def complete(chunk: Path) -> bool:
    """Whether a chunk directory holds everything `write_chunk` writes (it always does, unless
    someone removed a file since)."""
    return (chunk / "done").exists() and all((chunk / f"{n}.parquet").exists() for n in TABLES)


def start_run_dir(run_dir: Path, config: ManyModelsConfig) -> None:
    chunk_dir = run_dir / "chunks"
    try:
        chunk_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"cannot create {chunk_dir} ({e.strerror}); set job.run_dir to a writable directory"
        ) from None
    for stale in chunk_dir.glob("*.partial*"):  # a chunk being written when a run died
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)
    for chunk in chunk_dir.glob("chunk-*"):  # a chunk missing a file is run again
        if _CHUNK_NAME.fullmatch(chunk.name) and chunk.is_dir() and not complete(chunk):
            shutil.rmtree(chunk, ignore_errors=True)
    (run_dir / "job.toml").write_text(tomli_w.dumps(redacted_dump(config)))


def saved_chunk_size(run_dir: Path, series: int, done: set[int]) -> int:
    """The chunk size of the run being resumed (0 when no chunk is reused), checked against
    the data: chunks cut from other data would be reused for the wrong series."""
    if not done:
        return 0
    chunk_dir = run_dir / "chunks"
    try:
        saved = json.loads((chunk_dir / "layout.json").read_text())
        before, size = int(saved["series"]), int(saved["chunk_size"])
    except (OSError, ValueError, KeyError, TypeError):
        before, size = -1, 0
    if size < 1:
        raise ConfigError(
            f"--resume: {chunk_dir} holds finished chunks but no readable layout.json; use a new "
            "job.name or job.run_dir"
        )
    if before != series:
        raise ConfigError(
            f"--resume: the finished chunks in {chunk_dir} were cut from {before} series, the "
            f"data now has {series}; the data changed since: use a new job.name or job.run_dir"
        )
    if max(done) >= math.ceil(series / size):
        raise ConfigError(
            f"--resume: {chunk_dir / f'chunk-{max(done):06d}'} is beyond the "
            f"{math.ceil(series / size)} chunks of this run; remove it, or use a new job.run_dir"
        )
    return size


def choose_chunk_size(run_dir: Path, config: ManyModelsConfig, series: int, slots: int) -> int:
    """Series per task: enough chunks for every slot to take several (load balance), few enough
    that scheduling costs little (`even_chunk_size`)."""
    size = config.runner.chunk_size or even_chunk_size(series, slots)
    (run_dir / "chunks" / "layout.json").write_text(
        json.dumps({"series": series, "chunk_size": size})
    )
    return size


def even_chunk_size(series: int, slots: int) -> int:
    """The chunk size whose chunks fill the slots' last round as fully as any does (series as
    equal work: 7 chunks of 3 on 2 slots leave one idle a round, 10 of 2 none), the largest
    such of those that give every slot `_CHUNKS_PER_SLOT` chunks, at most `_MAX_CHUNK`."""
    largest = min(_MAX_CHUNK, max(1, math.ceil(series / (slots * _CHUNKS_PER_SLOT))))

    def rounds(size: int) -> int:  # the slots' busiest, in series
        return math.ceil(math.ceil(series / size) / slots) * size

    return min(range(largest, 0, -1), key=rounds)  # the first (largest) of the least


def write_chunk(chunk_dir: Path, index: int, result: ChunkResult) -> None:
    """Write a chunk's tables to a temporary directory, then rename it into place: a chunk
    directory is either complete or absent."""
    final = chunk_dir / f"chunk-{index:06d}"
    partial = chunk_dir / f"chunk-{index:06d}.partial-{os.getpid()}"
    partial.mkdir()
    for name, frame in result.tables().items():
        frame.write_parquet(partial / f"{name}.parquet")
    (partial / "done").write_text(
        json.dumps({"started": result.started, "finished": result.finished, "pid": result.pid})
    )
    os.replace(partial, final)
