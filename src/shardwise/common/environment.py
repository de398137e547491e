"""Environment variables set for a while: for the processes started meanwhile (Ray's, Spark's,
torch elastic's workers) and the libraries that read them then."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    """`os.environ` with `values` set while inside (for the processes started there, and the
    libraries that read it then), and as it was before afterwards."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


LAUNCHER_PID = "SHARDWISE_LAUNCHER_PID"
"""Set by shardwise's launcher for its ranks: its own pid (a rank forked by multiprocessing's
forkserver has the server as its parent, not the launcher)."""


def launcher_pid() -> int:
    """The pid of the process that launched this rank: `LAUNCHER_PID` where shardwise's launcher
    set it, else the parent (torchrun's agent)."""
    return int(os.environ.get(LAUNCHER_PID) or os.getppid())


def cache_dir() -> Path:
    """shardwise's cache on this machine (the calibrated profile, MLflow's empty store):
    SHARDWISE_CACHE, else $XDG_CACHE_HOME/shardwise, else ~/.cache/shardwise."""
    root = os.environ.get("SHARDWISE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "shardwise"
    )
    return Path(root)


def visible_cpus() -> int:
    """The CPU cores this process may run on (its affinity, unlike `os.cpu_count`)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
