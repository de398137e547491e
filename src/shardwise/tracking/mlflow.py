"""MLflow tracking on a background thread, so training never waits for the tracking store.

The training loop only puts records on a queue. A thread opens the store (an embedded SQLite file
in the run directory by default, or a server), creates or reopens the run, and sends metrics in
batches. If anything about MLflow fails, the thread warns once and drops what follows: training
goes on, and metrics.jsonl still has everything.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import warnings
from pathlib import Path
from typing import Any

_FLUSH_SECONDS = 1.0
_BATCH_LIMIT = 1000  # MLflow's log_batch accepts at most 1000 metrics per call
_CLOSE_TIMEOUT = 60.0


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
    ) -> None:
        """`artifact_dir` places artifacts of a new experiment (for a local store); `run_id`
        reopens an earlier run, as a resumed job does; `id_file` records the run id once known."""
        self.run_id: str | None = run_id
        self._id_file = id_file
        self.ready = threading.Event()
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._args = (uri, experiment, run_name, artifact_dir)
        self._failed = False
        self._thread = threading.Thread(target=self._run, name="shardwise-mlflow", daemon=True)
        self._thread.start()

    def log_params(self, params: dict[str, str]) -> None:
        self._queue.put(("params", params))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._queue.put(("metrics", (metrics, step, int(time.time() * 1000))))

    def log_artifact(self, path: Path) -> None:
        self._queue.put(("artifact", path))

    def close(self, status: str) -> None:
        self._queue.put(("close", status))
        self._thread.join(_CLOSE_TIMEOUT)
        if self._thread.is_alive():
            warnings.warn(
                f"MLflow did not finish within {_CLOSE_TIMEOUT:.0f}s; some metrics may be missing "
                "there (metrics.jsonl has them all)",
                stacklevel=2,
            )

    def _run(self) -> None:
        try:
            client = self._open()
        except Exception as e:  # any failure of the store must not reach training
            self._fail(e)
            client = None
        finally:
            self.ready.set()
        pending: list[Any] = []
        deadline = time.monotonic() + _FLUSH_SECONDS
        while True:
            try:
                kind, payload = self._queue.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                kind, payload = "flush", None
            if client is None:
                if kind == "close":
                    return
                continue
            try:
                if kind == "metrics":
                    pending.extend(_metric_entities(*payload))
                elif kind == "params":
                    self._log_params(client, payload)
                elif kind == "artifact":
                    client.log_artifact(self.run_id, str(payload))
                if kind in ("flush", "close") or len(pending) >= _BATCH_LIMIT:
                    for i in range(0, len(pending), _BATCH_LIMIT):
                        client.log_batch(self.run_id, metrics=pending[i : i + _BATCH_LIMIT])
                    pending.clear()
                    deadline = time.monotonic() + _FLUSH_SECONDS
                if kind == "close":
                    client.set_terminated(self.run_id, status=payload)
                    return
            except Exception as e:
                self._fail(e)
                client = None

    def _open(self) -> Any:
        from mlflow.tracking import MlflowClient

        # After the import: importing mlflow configures its loggers at INFO.
        logging.getLogger("mlflow").setLevel(logging.WARNING)
        logging.getLogger("alembic").setLevel(logging.WARNING)

        uri, experiment, run_name, artifact_dir = self._args
        client = MlflowClient(tracking_uri=uri)
        if self.run_id is None:
            found = client.get_experiment_by_name(experiment)
            experiment_id = (
                found.experiment_id
                if found
                else client.create_experiment(
                    experiment,
                    artifact_location=artifact_dir.resolve().as_uri() if artifact_dir else None,
                )
            )
            self.run_id = client.create_run(experiment_id, run_name=run_name).info.run_id
            if self._id_file is not None:
                self._id_file.write_text(self.run_id)
        else:
            client.update_run(self.run_id, status="RUNNING")
        return client

    def _log_params(self, client: Any, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        existing = client.get_run(self.run_id).data.params
        fresh = [Param(k, v[:6000]) for k, v in params.items() if k not in existing]
        for i in range(0, len(fresh), 100):  # MLflow accepts at most 100 params per batch
            client.log_batch(self.run_id, params=fresh[i : i + 100])

    def _fail(self, error: Exception) -> None:
        if not self._failed:
            self._failed = True
            warnings.warn(
                f"MLflow tracking stopped ({type(error).__name__}: {error}); training continues "
                "and metrics.jsonl keeps every metric",
                stacklevel=1,
            )


def _metric_entities(metrics: dict[str, float], step: int, timestamp: int) -> list[Any]:
    from mlflow.entities import Metric

    return [Metric(k, float(v), timestamp, step) for k, v in metrics.items()]
