"""What the chunk workers' fork server imports before it forks them (local_tasks.py): the
modules named in `WARM_ENV` (comma-separated: the chunk runner and the models' libraries), so
that they are imported once, not once per worker, and frozen (`gc.freeze`). A module that fails
to import is left: the worker building its model says what is wrong.

`start_server` starts that server; the CLI calls it as soon as it knows the job runs on worker
processes (placement.py), before it imports the runner, so that the server's imports overlap
the driver's.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import multiprocessing
import multiprocessing.forkserver
import os

from shardwise.common.environment import environment
from shardwise.common.spawned import without_main_module
from shardwise.manymodel.config import BUILTIN_MODELS, STATISTICAL_MODELS

WARM_ENV = "SHARDWISE_WARM_IMPORTS"
THREAD_ENV = {
    name: "1"
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "POLARS_MAX_THREADS")
}
"""The environment a worker process starts in: its numeric libraries use one thread each."""
LIBRARIES = {
    "ridge": "sklearn.linear_model",
    "lightgbm": "lightgbm",
    "mlp": "torch",
    **dict.fromkeys(STATISTICAL_MODELS, "statsforecast.models"),
}
"""What a built-in model's fit imports (seasonal naive: nothing)."""


def libraries(names: list[str]) -> list[str]:
    """The modules the models `names` import as they are built and fitted: the built-ins'
    libraries and user models' own modules."""
    found = [LIBRARIES.get(name) or ("" if name in BUILTIN_MODELS else name) for name in names]
    return list(dict.fromkeys(m.partition(":")[0] for m in found if m))


def worker_imports(names: list[str]) -> list[str]:
    """What a chunk worker of a job with the models `names` imports before its first chunk."""
    return ["shardwise.manymodel.run.chunk", *libraries(names)]


def start_server(names: list[str]) -> None:
    """Start the workers' fork server (multiprocessing's `forkserver`), importing
    `worker_imports(names)`, unless one runs already (a second job in the same process: its
    workers import what the server has not as they start). Returns at once."""
    multiprocessing.set_forkserver_preload([__name__])
    settings = {**THREAD_ENV, WARM_ENV: ",".join(worker_imports(names))}
    with environment(settings), without_main_module():
        multiprocessing.forkserver.ensure_running()


def warm(names: list[str]) -> None:
    """Import `names`, each where it can be."""
    for name in names:
        with contextlib.suppress(Exception):
            importlib.import_module(name)


_SERVER_IMPORTS = [name for name in os.environ.pop(WARM_ENV, "").split(",") if name]
if _SERVER_IMPORTS:  # in the fork server (its workers inherit its environment, not this list)
    warm(_SERVER_IMPORTS)
    # What it imported lives as long as the workers: frozen, their garbage collections never
    # walk it (statsforecast's hundreds of thousands of objects) nor copy its pages.
    gc.freeze()
    # The server ends once the job's process has (multiprocessing's alive pipe closes): without
    # freeing all that one object at a time, which kept the job's output open after it ended.
    atexit.register(os._exit, 0)
