"""Logging a model to MLflow and registering it in the Model Registry, for both products.

Training logs a checkpoint's model (training/tracking/registered_model.py) and many-models its
chosen forecasts (manymodel/serving/forecasts_pyfunc.py) as an MLflow pyfunc; this module does what
they share: checks that the store answers (within seconds, so a registry that is down costs one
line, not minutes of MLflow's retries), logs the model into a run (the training run, or a new one),
and registers it as a new version of a named model with tags. Every failure of the store becomes a
`RegistryError`, one line naming the store (its credentials hidden) and what went wrong.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardwise.common.environment import environment
from shardwise.common.errors import ConfigError, first_line
from shardwise.common.mlflow import experiment_id, open_client, sqlite_file
from shardwise.common.redact import redact, redacting_output

REACH_S = 10.0
"""How long the store has to answer the first request."""
_RETRIES = "2"
"""MLflow's HTTP retries after the store has answered (its default, 7 with backoff, is minutes)."""


class RegistryError(ConfigError):
    """The MLflow store could not take the model: down, refusing, or failing mid-way."""


@dataclass(frozen=True)
class Registered:
    """Where a logged model is: its run, its URI, and its registered name and version."""

    run_id: str
    model_uri: str
    """`models:/NAME/VERSION` when registered; else the logged model's own URI."""
    name: str = ""
    version: str = ""


@dataclass(frozen=True)
class Destination:
    """The store and run a model goes to: `run_id` an existing run (a training run), else a new
    run named `run_name` in `experiment`."""

    uri: str
    experiment: str
    run_name: str
    run_id: str | None = None
    registered_name: str = ""
    tags: dict[str, str] | None = None
    """The registered version's tags (metrics, step, checkpoint)."""


def log_pyfunc(destination: Destination, **model: Any) -> Registered:
    """Log `mlflow.pyfunc.log_model(name="model", **model)` to `destination`'s run and register
    it under `destination.registered_name` (when given). Callers `check_reachable` first, before
    the work of making the model."""
    where = f"MLflow at {redact(destination.uri)}"
    with _store(destination.uri), _failures(where):
        import mlflow

        with _run(destination) as run_id:
            info = mlflow.pyfunc.log_model(name="model", **model)
        if not destination.registered_name:
            return Registered(run_id=run_id, model_uri=info.model_uri)
        version = mlflow.register_model(
            info.model_uri, destination.registered_name, tags=destination.tags or {}
        )
        return Registered(
            run_id=run_id,
            model_uri=f"models:/{destination.registered_name}/{version.version}",
            name=destination.registered_name,
            version=str(version.version),
        )


def check_reachable(uri: str) -> None:
    """A `RegistryError` within `REACH_S` seconds when the store at `uri` cannot be used: a
    server that does not answer its health check, a local store whose directory is missing."""
    scheme = uri.split("://", 1)[0] if "://" in uri else "file"
    if scheme in ("http", "https"):
        import requests

        try:
            answer = requests.get(uri.rstrip("/") + "/health", timeout=REACH_S)
        except requests.RequestException as e:
            reason = type(e).__name__.replace("Error", " error").strip()
            raise RegistryError(
                f"MLflow at {redact(uri)} did not answer ({reason}); start the server or give "
                "another --uri / tracking.uri"
            ) from None
        if answer.status_code >= 400:
            raise RegistryError(
                f"MLflow at {redact(uri)} answered {answer.status_code} to its health check; "
                "check the server and its credentials"
            )
    elif scheme in ("sqlite", "file"):
        folder = (sqlite_file(uri) or Path(uri.removeprefix("file://"))).parent
        if not folder.is_dir():
            raise RegistryError(f"MLflow store {uri}: no directory {folder}")


@contextlib.contextmanager
def _store(uri: str) -> Iterator[None]:
    """MLflow pointed at `uri`, with few retries and its chatter (run links, progress bars,
    INFO logs) kept off the console; what it prints has credentials hidden."""
    import mlflow

    quiet = {
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": os.environ.get(
            "MLFLOW_HTTP_REQUEST_MAX_RETRIES", _RETRIES
        ),
        "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
    }
    previous = mlflow.get_tracking_uri(), mlflow.get_registry_uri()
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    levels = {n: logging.getLogger(n).level for n in ("mlflow", "alembic")}
    for name in levels:
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        with redacting_output(), environment(quiet):
            yield
    finally:
        mlflow.set_tracking_uri(previous[0])
        mlflow.set_registry_uri(previous[1])
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


@contextlib.contextmanager
def _run(destination: Destination) -> Iterator[str]:
    """The destination's run, active: the existing one reopened (left as it was when done), or a
    new one (finished when done)."""
    import mlflow

    client = open_client(destination.uri)
    if destination.run_id is not None:
        status = client.get_run(destination.run_id).info.status
        with mlflow.start_run(run_id=destination.run_id):
            yield destination.run_id
        client.set_terminated(destination.run_id, status=status)
        return
    # a new experiment in a local SQLite store keeps its artifacts beside the database, as a
    # training run's do (MLflow's default is `./mlruns` wherever the command runs)
    database = sqlite_file(destination.uri)
    beside = database.parent / "artifacts" if database is not None else None
    experiment = experiment_id(client, destination.experiment, beside)
    with mlflow.start_run(experiment_id=experiment, run_name=destination.run_name) as run:
        yield run.info.run_id


def pinned(names: list[str]) -> list[str]:
    """`name==version` of each installed distribution (a local build tag such as torch's `+cpu`
    left out, which pip could not resolve): a logged model's requirements."""
    return [f"{n}=={importlib.metadata.version(n).split('+')[0]}" for n in names]


@contextlib.contextmanager
def _failures(where: str) -> Iterator[None]:
    """Whatever the store raises, as one `RegistryError` line."""
    from mlflow.exceptions import MlflowException
    from requests import RequestException
    from sqlalchemy.exc import SQLAlchemyError  # a local store's database

    try:
        yield
    except RegistryError:
        raise
    except (MlflowException, RequestException, SQLAlchemyError, OSError) as e:
        first = redact(first_line(e))
        raise RegistryError(f"{where}: the model was not logged ({first[:300]})") from None
