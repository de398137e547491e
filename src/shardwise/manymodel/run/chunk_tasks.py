"""What every runner of chunk tasks shares (ray_tasks.py on Ray, local_tasks.py on this machine):
the order chunks run in, the progress line with its ETA, each finished chunk written to the chunk
store as it arrives, and the result of a chunk lost for good."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from shardwise.manymodel.columns import SERIES
from shardwise.manymodel.config import ManyModelsConfig
from shardwise.manymodel.features.feature_files import FeatureChunks
from shardwise.manymodel.run.chunk_result import ChunkResult
from shardwise.manymodel.run.chunk_store import write_chunk
from shardwise.manymodel.run.eta import Eta


def longest_first(features: FeatureChunks, todo: list[int]) -> list[int]:
    """The chunks to run, longest first, so the run does not end waiting on one long chunk (the
    work grows with the rows)."""
    return sorted(todo, key=lambda i: -features.rows[i])


class Finished:
    """Takes each chunk as it finishes: writes it to the chunk store, counts its series, and
    updates the progress bar (a log line per chunk where the console is not a terminal)."""

    def __init__(
        self,
        config: ManyModelsConfig,
        features: FeatureChunks,
        todo: list[int],
        done: set[int],
        slots: int,
        progress: Progress,
    ) -> None:
        self.config = config
        self.features = features
        self.intervals: list[tuple[float, float]] = []
        """Each chunk's start and end, as measured inside its task (`peak_concurrency`)."""
        self._progress = progress
        self._console = progress.console
        self._total = features.series
        self._finished = sum(len(features.series_of(i)) for i in done)
        self._failed = 0
        self._started = time.monotonic()
        self._eta = Eta(rows=sum(features.rows[i] for i in todo), slots=slots)
        self._bar = progress.add_task(
            "series", total=self._total, completed=self._finished, failed=0, eta="–"
        )

    def chunk(
        self,
        index: int,
        result: ChunkResult,
        took: float | None,
        spans: list[tuple[float, float]] | None = None,
    ) -> None:
        """Chunk `index` finished with `result`, after `took` seconds in its tasks (None: lost),
        which ran from start to end as `spans` says (None: one task, as `result` says)."""
        write_chunk(self.config.run_dir / "chunks", index, result)
        self.intervals += spans or [(result.started, result.finished)]
        self._failed += result.failed_series
        self._finished += result.series
        self._eta.done(self.features.rows[index], took, result.pid)
        left = self._eta.seconds()
        self._progress.update(
            self._bar, completed=self._finished, failed=self._failed, eta=f"{left:.0f} s"
        )
        if not self._console.is_terminal:  # a log line per chunk instead of a bar
            self._console.print(
                f"series {self._finished}/{self._total} done · {self._failed} failed · "
                f"{time.monotonic() - self._started:.0f} s · ETA {left:.0f} s",
                highlight=False,
            )


@contextmanager
def progress_of(
    config: ManyModelsConfig,
    features: FeatureChunks,
    todo: list[int],
    done: set[int],
    slots: int,
    console: Console,
) -> Iterator[Finished]:
    """The progress bar of a run's chunks, and what takes each as it finishes."""
    with Progress(
        TextColumn("[bold]series"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} done · {task.fields[failed]} failed"),
        TimeElapsedColumn(),
        TextColumn("ETA {task.fields[eta]}"),
        console=console,
        transient=False,
        disable=not console.is_terminal,
    ) as progress:
        yield Finished(config, features, todo, done, slots, progress)


def lost_chunk(series: range, error: str, levels: tuple[int, ...]) -> ChunkResult:
    """A chunk whose worker died more often than `runner.max_retries`: every series in it failed
    (its tables have the interval columns of the others, `levels`)."""
    result = ChunkResult(started=time.time(), finished=time.time(), levels=levels)
    message = f"worker lost after retries ({error})"
    for number in series:
        result.failures.append({SERIES: number, "model": "*", "stage": "task", "error": message})
        result.series += 1
        result.failed_series += 1
    return result


def peak_concurrency(intervals: list[tuple[float, float]]) -> int:
    """Most chunks that were running at the same moment, from their measured start and end."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    peak = running = 0
    for _, change in events:
        running += change
        peak = max(peak, running)
    return peak
