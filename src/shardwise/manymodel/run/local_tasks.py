"""Running a many-models job's chunks on this machine without Ray: in worker processes of its
own, or in this process where one worker would run every chunk anyway.

Which runs a job, these or Ray, `placement.choose` says.

Workers are forked from a fork server (multiprocessing's `forkserver`: a fresh process, never the
driver, which has polars' threads and a fork could copy a lock one of them holds) that imported
the chunk runner and the models' libraries once (`warm_imports.py`; statsforecast takes a second
of CPU to import, which spawned workers each paid), with one thread for each numeric library
(`THREAD_ENV`), `runner.num_cpus` each: as many as the cores hold. Each takes one task at a
time over a pipe, longest first, and sends its result back; the driver gives it the next, then
writes the result to the chunk store. A task is a chunk, except in the last round: each of the
last chunks runs in parts (`in_parts`), so that no worker is left running a whole chunk at the
end while the others idle, and is written once its parts have come (`ChunkResult.joined`: the
tables a whole run would have made). A worker that dies (killed, out of memory, a model that
exits) costs the task it ran an attempt: the task runs again on a new worker, up to
`runner.max_retries` times, then its series fail (`lost_chunk`), as on Ray.
"""

from __future__ import annotations

import contextlib
import multiprocessing
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import polars as pl
from rich.console import Console

from shardwise.common.environment import environment
from shardwise.common.spawned import without_main_module
from shardwise.manymodel.columns import SERIES
from shardwise.manymodel.config import ManyModelsConfig
from shardwise.manymodel.evaluation.backtest import Plan
from shardwise.manymodel.features.feature_files import FeatureChunks
from shardwise.manymodel.run.chunk import run_chunk
from shardwise.manymodel.run.chunk_result import ChunkResult
from shardwise.manymodel.run.chunk_tasks import Finished, longest_first, lost_chunk, progress_of
from shardwise.manymodel.run.placement import Backend
from shardwise.manymodel.run.warm_imports import THREAD_ENV, start_server, warm, worker_imports

STOP_S = 10.0
"""How long a worker has to exit once told to, before it is terminated."""


def run_local(
    config: ManyModelsConfig,
    where: tuple[Backend, Pool | None],
    plan: Plan,
    features: FeatureChunks,
    todo: list[int],
    done: set[int],
    console: Console,
) -> list[tuple[float, float]]:
    """Run the chunks `todo` as the backend says: on the `Pool` started for it, or in this
    process; each chunk's start and end."""
    backend, pool = where
    queue = longest_first(features, todo)
    with progress_of(config, features, todo, done, backend.slots, console) as finished:
        if pool is None:
            for index in queue:
                result = run_chunk(features.read(index), plan)
                finished.chunk(index, result, result.finished - result.started)
        else:
            pool.run(plan, features, queue, finished)
    return finished.intervals


TAIL_PARTS = 8
"""The parts (of whole series) each of the last chunks runs in: the job's end does not wait on
one worker running a whole chunk while the others have nothing left to take."""


@dataclass(frozen=True)
class Part:
    """Series of a chunk that one task runs: all of them, or a part of one of the last chunks."""

    index: int
    """The chunk."""
    series: range
    of: int
    """The parts the chunk runs in (1: whole)."""


def in_parts(features: FeatureChunks, queue: list[int], slots: int) -> list[Part]:
    """The chunks `queue` as tasks, in that order: each whole, except the last `slots` where
    there are more chunks than slots (the last round), each in up to `TAIL_PARTS` parts."""
    last = len(queue) - slots if len(queue) > slots else len(queue)
    parts = []
    for position, index in enumerate(queue):
        series = features.series_of(index)
        size = len(series)
        of = min(TAIL_PARTS, size) if position >= last else 1
        parts += [Part(index, series[k * size // of : (k + 1) * size // of], of) for k in range(of)]
    return parts


@dataclass
class _Worker:
    process: Any
    conn: Connection
    part: int | None = None
    """The task it runs (a position in the run's parts; None: idle)."""
    planned: bool = False
    """Whether it has been sent the plan."""


class Pool:
    """Worker processes, each running one chunk at a time (module docstring). Their fork server
    starts as soon as the job is known to need them, before its data is read (the CLI starts it
    earlier still: `placement.prestart`), and imports what the models need while the driver
    reads the data and plans; the workers are forked from it when the first chunks are ready.
    `stop` ends them (a `with` block does)."""

    def __init__(self, config: ManyModelsConfig, slots: int) -> None:
        self.slots = slots
        self.retries = config.runner.max_retries
        self._names = config.models.names
        self._context = multiprocessing.get_context("forkserver")
        self._workers: list[_Worker] = []

    def __enter__(self) -> Pool:
        start_server(self._names)  # where the CLI has not already
        return self

    def __exit__(self, *failed: object) -> None:
        self.stop(wait_s=STOP_S if failed[0] is None else 0.0)

    def stop(self, wait_s: float = STOP_S) -> None:
        """End the workers (`_stop`); again: nothing."""
        _stop(self._workers, wait_s)
        self._workers = []

    def run(self, plan: Plan, features: FeatureChunks, queue: list[int], done: Finished) -> None:
        """Run the chunks `queue` (in that order, the last ones in parts: `in_parts`) of
        `features` by `plan`; each chunk's result to `done` once its parts have come."""
        tasks = _Tasks(features, queue, self.slots, done)
        wanted = max(1, min(self.slots, len(tasks.parts)))
        self._workers += [self._start() for _ in range(wanted - len(self._workers))]
        workers = self._workers[:wanted]
        while tasks.todo or any(w.part is not None for w in workers):
            _give(workers, plan, tasks)
            busy = [w for w in workers if w.part is not None]
            wait([w.conn for w in busy] + [w.process.sentinel for w in busy])
            finished = [came for w in busy if (came := self._take(w, workers, tasks, plan))]
            _give(workers, plan, tasks)  # the next tasks out before the chunk store is written
            for position, result, took in finished:
                tasks.finish(position, result, took)

    def _take(
        self, worker: _Worker, workers: list[_Worker], tasks: _Tasks, plan: Plan
    ) -> tuple[int, ChunkResult, float | None] | None:
        """The busy `worker`'s task and its result where it has sent one, or the task lost for
        good where the worker died once too often (where less often, the task is queued again);
        a dead worker replaced. None: still running, or to run again."""
        position = worker.part
        assert position is not None
        result = _result(worker)
        if result is not None:
            worker.part = None
            return position, result, result.finished - result.started
        if worker.process.is_alive():
            return None
        new = self._start()  # died: its task again, or lost
        workers[workers.index(worker)] = new
        self._workers[self._workers.index(worker)] = new
        tasks.attempts[position] = tasks.attempts.get(position, 0) + 1
        if tasks.attempts[position] <= self.retries:
            tasks.todo.insert(0, position)
            return None
        why = f"its worker exited with code {worker.process.exitcode}"
        return position, lost_chunk(tasks.parts[position].series, why, plan.levels), None

    def _start(self) -> _Worker:
        """A worker forked from the server (waiting, the first time, for its imports)."""
        ours, theirs = self._context.Pipe()
        process = self._context.Process(
            target=_serve,
            args=(theirs, worker_imports(self._names)),
            name="shardwise-chunks",
            daemon=True,
        )
        with environment(THREAD_ENV), without_main_module():  # models are named by import
            process.start()  # path, never in __main__
        theirs.close()
        return _Worker(process, ours)


class _Tasks:
    """A run's tasks (`in_parts`): those left to give out, each one's rows, and each chunk
    handed on (`Finished.chunk`) once all its parts have come."""

    def __init__(
        self, features: FeatureChunks, queue: list[int], slots: int, done: Finished
    ) -> None:
        self.features, self.done = features, done
        self.parts = in_parts(features, queue, slots)
        self.todo = list(range(len(self.parts)))
        """Positions in `parts` not yet given out (or to give out again)."""
        self.attempts: dict[int, int] = {}
        self._came: dict[int, dict[int, tuple[ChunkResult, float | None]]] = {}
        self._read: tuple[int, pl.DataFrame] | None = None
        """The chunk read last: its next parts come from it."""

    def rows(self, position: int) -> pl.DataFrame:
        part = self.parts[position]
        if self._read is None or self._read[0] != part.index:
            self._read = (part.index, self.features.read(part.index))
        if part.of == 1:
            return self._read[1]
        first, last = part.series.start, part.series.stop - 1
        return self._read[1].filter(pl.col(SERIES).is_between(first, last))

    def finish(self, position: int, result: ChunkResult, took: float | None) -> None:
        """Task `position` ran, giving `result` after `took` seconds (None: lost)."""
        part = self.parts[position]
        pieces = self._came.setdefault(part.index, {})
        pieces[position] = (result, took)
        if len(pieces) < part.of:
            return
        del self._came[part.index]  # handed on: not held while the rest of the run goes on
        results = [pieces[k][0] for k in sorted(pieces)]
        times = [pieces[k][1] for k in sorted(pieces)]
        self.done.chunk(
            part.index,
            ChunkResult.joined(results),
            None if None in times else sum(t for t in times if t is not None),
            [(r.started, r.finished) for r in results],
        )


def _give(workers: list[_Worker], plan: Plan, tasks: _Tasks) -> None:
    """A task to every idle worker while there are tasks left (the plan first, once)."""
    for worker in workers:
        if worker.part is None and tasks.todo:
            if not worker.planned:
                worker.conn.send(plan)
                worker.planned = True
            worker.part = tasks.todo.pop(0)
            worker.conn.send((worker.part, tasks.rows(worker.part)))


def _result(worker: _Worker) -> ChunkResult | None:
    """The worker's result where it has sent one (None: still running, or dead)."""
    try:
        if not worker.conn.poll():
            return None
        index, result = worker.conn.recv()
    except (EOFError, OSError):  # the worker died
        return None
    assert index == worker.part
    return result  # type: ignore[no-any-return]


def _serve(conn: Connection, names: list[str]) -> None:
    """A worker: import `warm` (where its server has not), take the plan, then run each chunk
    it is sent and send back its result; stop at None or EOF."""
    warm(names)
    plan: Plan | None = None
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        if isinstance(job, Plan):
            plan = job
            continue
        assert plan is not None, "the plan comes before the chunks"
        index, rows = job
        conn.send((index, run_chunk(rows, plan)))


def _stop(workers: list[_Worker], wait_s: float) -> None:
    """Tell every worker to stop, then terminate those that have not within `wait_s` (0: a
    run that failed or was interrupted, whose workers may be mid-chunk)."""
    for worker in workers:
        with contextlib.suppress(OSError):
            worker.conn.send(None)
    for worker in workers:
        worker.process.join(wait_s)
        if worker.process.is_alive():
            worker.process.terminate()
            worker.process.join()
        worker.conn.close()
