"""MLflow tracking in a separate, low-priority process, so training never waits for the store.

The training process only puts records on a queue (a background feeder thread writes them to a
pipe). A child process, at lower CPU priority (the trainer's again when the run ends and the
trainer waits on it, where the system allows it), imports MLflow, opens the store (an embedded
SQLite file in the run directory by default, or a server), creates or reopens the run, and sends
metrics in batches. It is a process rather than a thread because MLflow's work is Python
(SQLAlchemy, request handling) that would otherwise hold the trainer's GIL and slow its steps.

The child also samples the machine (CPU and memory, and GPU utilisation and memory where NVIDIA's
management library sees a GPU) as MLflow's system metrics (`system/…`) every
`system_metrics_s` seconds while the run is open: the trainer's node as it trains, sampled
outside the trainer's process (the first sample comes one interval after the run is open).

If anything about MLflow fails, the child reports it once and drops what follows: training goes
on with a warning, and metrics.jsonl still has everything. If the trainer dies, the child notices
that its parent is gone, marks the run failed and exits.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import multiprocessing
import os
import queue
import shutil
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from shardwise.common.console import warn
from shardwise.common.environment import cache_dir
from shardwise.common.redact import redacting_output
from shardwise.common.spawned import without_main_module

_FLUSH_SECONDS = 1.0
_BATCH_LIMIT = 1000  # MLflow's log_batch accepts at most 1000 metrics per call
# Closing the run waits for the child as long as it works: a child at nice 19 on a machine other
# work keeps busy can take minutes to import MLflow and flush, and is not stuck. One that has
# used no CPU for this long is (a store that does not answer), and is stopped.
_STALLED_SECONDS = 120.0
# The lowest priority: when the trainer's ranks keep every core busy, MLflow's start-up (importing
# it, opening the store: seconds of CPU) and its batches happen in the time the ranks leave idle.
# A higher one still costs the ranks throughput (bench/ddp_overhead.py measures it).
_NICENESS = 19


class MlflowTracker:
    def __init__(
        self,
        *,
        uri: str,
        experiment: str,
        run_name: str,
        artifact_dir: Path | None,
        run_id: str | None = None,
        id_file: Path | None = None,
        system_metrics_s: float = 0.0,
    ) -> None:
        """`artifact_dir` places artifacts of a new experiment (for a local store); `run_id`
        reopens an earlier run, as a resumed job does; `id_file` records the run id once known;
        `system_metrics_s` > 0 samples the machine that often (0: not at all)."""
        self._run_id: str | None = run_id
        context = multiprocessing.get_context("spawn")
        self._requests: Any = context.Queue()
        self._replies: Any = context.Queue()
        settings = (
            uri, experiment, run_name, artifact_dir, run_id, id_file, os.getpid(), system_metrics_s
        )  # fmt: skip
        self._process = context.Process(
            target=_serve,
            args=(self._requests, self._replies, settings),
            name="shardwise-mlflow",
            daemon=True,
        )
        with without_main_module():
            self._process.start()

    @property
    def run_id(self) -> str | None:
        self._poll()
        return self._run_id

    def log_params(self, params: dict[str, str]) -> None:
        self._requests.put(("params", params))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._requests.put(("metrics", (metrics, step, int(time.time() * 1000))))
        self._poll()

    def log_artifact(self, path: Path) -> None:
        self._requests.put(("artifact", path))

    def log_input(self, dataset: dict[str, Any]) -> None:
        self._requests.put(("input", dataset))

    def close(self, status: str) -> None:
        self._requests.put(("close", status))
        hasten(self._process.pid)  # what is left of the run waits on it now
        if not wait_while_working(self._process, _STALLED_SECONDS):
            self._process.terminate()
            self._process.join()
            warn(
                f"MLflow did no work for {_STALLED_SECONDS:.0f}s while closing the run (a store "
                "that does not answer?); some metrics may be missing there (metrics.jsonl has "
                "them all)",
                stacklevel=2,
            )
        self._poll()  # the child has exited: its replies are all in the pipe
        self._requests.close()
        self._replies.close()

    def _poll(self) -> None:
        """Take the child's replies: the run id once known, warnings when something failed."""
        while True:
            try:
                kind, value = self._replies.get_nowait()
            except (queue.Empty, OSError, ValueError):
                return
            if kind == "run_id":
                self._run_id = value
            else:
                warn(value, stacklevel=3)


def hasten(pid: int | None) -> None:
    """Run the process `pid` (every thread of it) at this process's priority where the system
    allows it (raising a priority takes CAP_SYS_NICE or an RLIMIT_NICE above 0); where it does
    not, it keeps its own."""
    import psutil

    if pid is None:
        return
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    with contextlib.suppress(OSError, psutil.Error):
        for thread in psutil.Process(pid).threads():  # Linux: each thread has its own
            os.setpriority(os.PRIO_PROCESS, thread.id, mine)


def wait_while_working(process: Any, stalled_s: float) -> bool:
    """Wait for `process` (a multiprocessing.Process) to end while it uses CPU: True once it
    has ended, False once it has used none for `stalled_s` seconds."""
    import psutil

    try:
        watched = psutil.Process(process.pid)
        used, since = sum(watched.cpu_times()[:2]), time.monotonic()
        while process.exitcode is None:
            process.join(min(1.0, stalled_s))
            now = sum(watched.cpu_times()[:2])
            if now > used:
                used, since = now, time.monotonic()
            elif process.exitcode is None and time.monotonic() - since >= stalled_s:
                return False
    except psutil.NoSuchProcess:  # ended (and reaped) between two looks
        process.join()
    return True


def _serve(requests: Any, replies: Any, settings: tuple[Any, ...]) -> None:
    """The tracking process: open the store, then batch what the trainer sends until it closes
    the run. After a failure, keep reading (and dropping) until then."""
    uri, experiment, run_name, artifact_dir, run_id, id_file, parent, every = settings
    os.nice(_NICENESS)
    with redacting_output():  # MLflow prints the tracking URI ("View run at …")
        try:
            resumed = run_id is not None
            client, run_id = _open(uri, experiment, run_name, artifact_dir, run_id, id_file)
            replies.put(("run_id", run_id))
            with _sampling(uri, run_id, every, resumed=resumed):
                _record(client, run_id, requests, parent)
        except Exception as e:  # any failure of the store must not reach training
            replies.put(
                (
                    "warning",
                    f"MLflow tracking stopped ({type(e).__name__}: {e}); training continues "
                    "and metrics.jsonl keeps every metric",
                )
            )
            _drain(requests, parent)
    replies.close()
    replies.join_thread()  # every reply written to the pipe
    # Nothing is left to do: skip the interpreter's shutdown, where joining MLflow's telemetry
    # thread kept a closed run's process alive, and the job that closed it waiting.
    os._exit(0)


@contextlib.contextmanager
def _sampling(uri: str, run_id: str, every: float, *, resumed: bool) -> Iterator[None]:
    """MLflow's system-metrics monitor on this run while the body runs (`every` seconds; 0: off).
    It samples on a thread of its own and logs through its own client."""
    if every <= 0:
        yield
        return
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    monitor = SystemMetricsMonitor(
        run_id, sampling_interval=every, resume_logging=resumed, tracking_uri=uri
    )
    monitor.start()
    try:
        yield
    finally:
        monitor.finish()


def _record(client: Any, run_id: str, requests: Any, parent: int) -> None:
    pending: list[Any] = []
    deadline = time.monotonic() + _FLUSH_SECONDS
    while True:
        kind, payload = _next(requests, deadline, parent)
        if kind == "metrics":
            pending.extend(_metric_entities(*payload))
        elif kind == "params":
            _log_params(client, run_id, payload)
        elif kind == "artifact":
            client.log_artifact(run_id, str(payload))
        elif kind == "input":
            _log_input(client, run_id, payload)
        if kind in ("flush", "close") or len(pending) >= _BATCH_LIMIT:
            for i in range(0, len(pending), _BATCH_LIMIT):
                client.log_batch(run_id, metrics=pending[i : i + _BATCH_LIMIT])
            pending.clear()
            deadline = time.monotonic() + _FLUSH_SECONDS
        if kind == "close":
            client.set_terminated(run_id, status=payload)
            return


def _log_input(client: Any, run_id: str, dataset: dict[str, Any]) -> None:
    """A training dataset as MLflow's run input (`mlflow.log_input`): its name, where it is,
    and its version as the digest, so that the run says which data it trained on."""
    from mlflow.entities import Dataset, DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    version = json.dumps(dataset["version"], sort_keys=True)
    entity = Dataset(
        name=dataset["name"],
        digest=hashlib.sha256(version.encode()).hexdigest()[:16],
        source_type=dataset["kind"],
        source=json.dumps({"uri": dataset["where"], "version": dataset["version"]}),
        schema=json.dumps({"columns": dataset["columns"]}),
        profile=json.dumps({"rows": dataset["rows"], "files": dataset["files"]}),
    )
    tags = [InputTag(key=MLFLOW_DATASET_CONTEXT, value=dataset["context"])]
    client.log_inputs(run_id, datasets=[DatasetInput(entity, tags)])


def _drain(requests: Any, parent: int) -> None:
    while _next(requests, time.monotonic() + _FLUSH_SECONDS, parent)[0] != "close":
        pass


def _next(requests: Any, deadline: float, parent: int) -> tuple[str, Any]:
    """The next request; `flush` when the deadline passes first; `close` with FAILED when the
    trainer died without closing the run."""
    try:
        request: tuple[str, Any] = requests.get(timeout=max(deadline - time.monotonic(), 0.01))
    except queue.Empty:
        request = ("flush", None)
    if os.getppid() != parent:
        return "close", "FAILED"
    return request


def _open(
    uri: str,
    experiment: str,
    run_name: str,
    artifact_dir: Path | None,
    run_id: str | None,
    id_file: Path | None,
) -> tuple[Any, str]:
    import mlflow  # noqa: F401

    # After the import: importing mlflow configures its loggers at INFO.
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)

    client = open_client(uri)
    if run_id is None:
        found = experiment_id(client, experiment, artifact_dir)
        run_id = client.create_run(found, run_name=run_name).info.run_id
        if id_file is not None:
            id_file.write_text(run_id)
    else:
        client.update_run(run_id, status="RUNNING")
    return client, run_id


def open_client(uri: str) -> Any:
    """An `MlflowClient` of the store at `uri`; a local SQLite store that does not exist yet is
    created whole (`create_sqlite_store`)."""
    from mlflow.tracking import MlflowClient

    create_sqlite_store(uri)
    return MlflowClient(tracking_uri=uri)


def create_sqlite_store(uri: str) -> None:
    """Create the SQLite store of `uri` if there is none, at once. MLflow builds a new store's
    schema in some 60 migrations (seconds); a process killed among them (a run stopped in its
    first seconds, a Spark stage cancelled) would leave a database that every later open refuses
    ("table … already exists"). So the schema is built in a file beside it and linked into place
    when complete; where another process got there first, its database stays. A file left by a
    builder that was killed is removed."""
    path = sqlite_file(uri)
    if path is None:
        return
    _remove_left_by_the_killed(path)
    if path.exists():
        return
    building = path.with_name(f".{path.name}.{os.getpid()}.creating")
    try:
        if not _copy_empty_store(building):
            _build_store(building)
        with contextlib.suppress(FileExistsError):
            os.link(building, path)
    finally:
        building.unlink(missing_ok=True)


def _remove_left_by_the_killed(path: Path) -> None:
    """Remove the files where a process since killed was building the store `path`."""
    for left in path.parent.glob(f".{path.name}.*.creating"):
        pid = left.name.rsplit(".", 2)[-2]
        if pid.isdigit() and not _alive(int(pid)):
            left.unlink(missing_ok=True)


def _build_store(path: Path) -> str:
    """A new store at `path`, as MLflow builds it (its migrations); the artifact location MLflow
    gives its Default experiment there."""
    from mlflow.tracking import MlflowClient

    MlflowClient(tracking_uri=f"sqlite:///{path}")
    with contextlib.closing(sqlite3.connect(path)) as db:
        return str(db.execute(_DEFAULT_LOCATION).fetchone()[0])


_DEFAULT_LOCATION = "SELECT artifact_location FROM experiments WHERE experiment_id = 0"


def _copy_empty_store(path: Path) -> bool:
    """Copy this MLflow version's empty store to `path`, its Default experiment made as MLflow
    would make it here and now (artifact location under this directory, times). The empty store
    is built once per machine in shardwise's cache, as MLflow builds one: its migrations would
    cost a tracking process seconds in every new run directory. False, and
    nothing at `path`, where the cache cannot be written or MLflow is told to lay out a store
    otherwise (workspaces, a server's artifact root)."""
    import mlflow
    from mlflow.environment_variables import MLFLOW_ENABLE_WORKSPACES
    from mlflow.tracking._tracking_service import utils

    root = getattr(utils, "_SERVER_ARTIFACT_ROOT_ENV_VAR", None)
    if MLFLOW_ENABLE_WORKSPACES.get() or (root and os.environ.get(root)):
        return False
    here = os.path.join(os.path.abspath("mlruns"), "0")
    empty = cache_dir() / f"mlflow-{mlflow.__version__}-empty.db"
    try:
        if not empty.exists():
            empty.parent.mkdir(parents=True, exist_ok=True)
            _remove_left_by_the_killed(empty)
            making = empty.with_name(f".{empty.name}.{os.getpid()}.creating")
            try:
                if _build_store(making) != here:  # not where this expects: keep MLflow's own
                    os.replace(making, path)
                    return True
                with contextlib.suppress(FileExistsError):
                    os.link(making, empty)
            finally:
                making.unlink(missing_ok=True)
        shutil.copyfile(empty, path)
        now = int(time.time() * 1000)
        with contextlib.closing(sqlite3.connect(path)) as db, db:
            db.execute(
                "UPDATE experiments SET artifact_location = ?, creation_time = ?, "
                "last_update_time = ? WHERE experiment_id = 0",
                (here, now, now),
            )
    except (OSError, sqlite3.Error):
        path.unlink(missing_ok=True)
        return False
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sqlite_file(uri: str) -> Path | None:
    """The database file of a local SQLite store's URI; None for a server."""
    return Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None


def experiment_id(client: Any, name: str, artifact_dir: Path | None) -> str:
    """The id of the experiment `name`, created where there is none yet (its artifacts in
    `artifact_dir` where given; else where the store puts them). Where another process created
    it since it was looked for (runs that start together), the one that process created."""
    from mlflow.exceptions import MlflowException

    found = client.get_experiment_by_name(name)
    if found:
        return str(found.experiment_id)
    location = artifact_dir.resolve().as_uri() if artifact_dir else None
    try:
        return str(client.create_experiment(name, artifact_location=location))
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return str(found.experiment_id)


def _log_params(client: Any, run_id: str, params: dict[str, str]) -> None:
    from mlflow.entities import Param

    existing = client.get_run(run_id).data.params
    fresh = [Param(k, v[:6000]) for k, v in params.items() if k not in existing]
    for i in range(0, len(fresh), 100):  # MLflow accepts at most 100 params per batch
        client.log_batch(run_id, params=fresh[i : i + 100])


def _metric_entities(metrics: dict[str, float], step: int, timestamp: int) -> list[Any]:
    from mlflow.entities import Metric

    return [Metric(k, float(v), timestamp, step) for k, v in metrics.items()]
