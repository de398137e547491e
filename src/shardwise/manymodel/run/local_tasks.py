"""Running a many-models job's chunks on this machine without Ray: in worker processes of its
own, or in this process where one worker would run every chunk anyway.

Which runs a job, these or Ray, `placement.choose` says.

Workers are forked from a fork server (multiprocessing's `forkserver`: a fresh process, never the
driver, which has polars' threads and a fork could copy a lock one of them holds) that imported
the chunk runner and the models' libraries once (`warm_imports.py`; statsforecast takes a second
of CPU to import, which spawned workers each paid), with one thread for each numeric library
(`THREAD_ENV`), `runner.num_cpus` each: as many as the cores hold. Each takes one chunk at a
time over a pipe, longest first, and sends its result back; the driver writes it to the chunk
store as it arrives. A worker that dies (killed, out of memory, a model that exits) costs the
chunk it ran an attempt: the chunk runs again on a new worker, up to `runner.max_retries` times,
then its series fail (`lost_chunk`), as on Ray.
"""

from __future__ import annotations

import contextlib
import multiprocessing
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from rich.console import Console

from shardwise.common.environment import environment
from shardwise.common.spawned import without_main_module
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


@dataclass
class _Worker:
    process: Any
    conn: Connection
    index: int | None = None
    """The chunk it runs (None: idle)."""
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
        """Run the chunks `queue` (in that order) of `features` by `plan`; each result to
        `done` as it arrives."""
        attempts: dict[int, int] = {}
        wanted = max(1, min(self.slots, len(queue)))
        self._workers += [self._start() for _ in range(wanted - len(self._workers))]
        workers = self._workers[:wanted]
        while queue or any(w.index is not None for w in workers):
            for worker in workers:
                if worker.index is None and queue:
                    if not worker.planned:
                        worker.conn.send(plan)
                        worker.planned = True
                    worker.index = queue.pop(0)
                    worker.conn.send((worker.index, features.read(worker.index)))
            busy = [w for w in workers if w.index is not None]
            wait([w.conn for w in busy] + [w.process.sentinel for w in busy])
            for worker in busy:
                index = worker.index
                assert index is not None
                result = _result(worker)
                if result is not None:
                    worker.index = None
                    done.chunk(index, result, result.finished - result.started)
                elif not worker.process.is_alive():  # died: its chunk again, or lost
                    attempts[index] = attempts.get(index, 0) + 1
                    if attempts[index] > self.retries:
                        why = f"its worker exited with code {worker.process.exitcode}"
                        series = features.series_of(index)
                        done.chunk(index, lost_chunk(series, why, plan.levels), None)
                    else:
                        queue.insert(0, index)
                    new = self._start()
                    workers[workers.index(worker)] = new
                    self._workers[self._workers.index(worker)] = new

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


def _result(worker: _Worker) -> ChunkResult | None:
    """The worker's result where it has sent one (None: still running, or dead)."""
    try:
        if not worker.conn.poll():
            return None
        index, result = worker.conn.recv()
    except (EOFError, OSError):  # the worker died
        return None
    assert index == worker.index
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
