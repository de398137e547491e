"""Where metrics go: the `Tracker` interface, and the JSONL file every run has.

Trackers live on rank 0 only. A tracker must never raise into the training loop or block it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Protocol


class Tracker(Protocol):
    def log_params(self, params: dict[str, str]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def log_artifact(self, path: Path) -> None: ...
    def log_input(self, dataset: dict[str, Any]) -> None:
        """A dataset the run reads: name, kind, where, version, columns, rows, files, context."""

    def close(self, status: str) -> None:
        """Flush and finish; `status` is `FINISHED` or `FAILED`."""


class JsonlTracker:
    """One JSON object per line in `<run_dir>/metrics.jsonl`: `{"step", "time", <metrics>}`.

    The file is appended to, never truncated. Each run first writes `{"event": "start"}` or
    `{"event": "resume", "step": N}`; after a resume, the steps since the checkpoint appear again
    with their recomputed values.
    """

    def __init__(self, path: Path, *, resumed_from: int | None = None) -> None:
        self.path = path
        # Line-buffered: a crash loses at most the line being written.
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 (open for the run's lifetime)
        if resumed_from is None:
            self._write({"event": "start", "step": 0, "time": time.time()})
        else:
            self._write({"event": "resume", "step": resumed_from, "time": time.time()})

    def log_params(self, params: dict[str, str]) -> None:
        pass  # the resolved config is saved next to this file as config.toml

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._write({"step": step, "time": time.time(), **metrics})

    def log_artifact(self, path: Path) -> None:
        pass

    def log_input(self, dataset: dict[str, Any]) -> None:
        pass  # the version is in config.toml and in every checkpoint's manifest

    def close(self, status: str) -> None:
        self._file.close()

    def _write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl file."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def last_logged_step(path: Path, tail: int = 1 << 16) -> int | None:
    """The step of a metrics.jsonl file's last record with a loss (None: none), read from its
    last `tail` bytes (a line cut by a writer that was killed is skipped)."""
    if not path.exists():
        return None
    with path.open("rb") as file:
        file.seek(max(0, file.seek(0, 2) - tail))
        lines = file.read().decode(errors="replace").splitlines()
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "loss" in record and "step" in record:
            return int(record["step"])
    return None


class Trackers:
    """Fan out to several trackers."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers

    def log_params(self, params: dict[str, str]) -> None:
        for t in self.trackers:
            t.log_params(params)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for t in self.trackers:
            t.log_metrics(metrics, step)

    def log_artifact(self, path: Path) -> None:
        for t in self.trackers:
            t.log_artifact(path)

    def log_input(self, dataset: dict[str, Any]) -> None:
        for t in self.trackers:
            t.log_input(dataset)

    def close(self, status: str) -> None:
        for t in self.trackers:
            t.close(status)
