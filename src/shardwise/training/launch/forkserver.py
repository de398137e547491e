"""Workers forked from a server that has imported torch and the trainer once.

A spawned rank is a new interpreter that imports torch, DTensor, torch._dynamo (which
DistributedDataParallel imports) and the trainer before it does anything: about 4 s of CPU per
rank on the development machine, paid again by every rank of every launch and restart.
multiprocessing's forkserver pays it once: the server imports `PRELOAD` when it starts and forks
each rank from that state. A 2-rank digits run of 4 steps took 10.5 CPU-s and 8.5 s with spawned
ranks, 7.4 CPU-s and 6.1 s with forked ones; a node of 8 ranks saves 7 imports per launch.

The server is a clean process (started by exec, not forked from the launcher, whose threads it does
not inherit); it imports modules only, and initialises neither CUDA nor OpenMP's thread pool, so
the forked ranks start as spawned ones do.

A rank sees the launching process's environment, `sys.path` and working directory, as a spawned
one does. multiprocessing hands each forked child the last two; the environment is the server's,
from when it started, so a rank first applies what has changed in the launcher since
(`forked`). What the server imported may have read the environment, though (torch reads
`TORCH_*` variables as it imports, numpy its BLAS settings), so when a variable changes, or
`sys.path` or the directory, the server is started again, unless the variable is one that is
read only as a rank runs (`RUNTIME_ONLY`). A Python caller that launches many times (a sweep, a
test suite: pytest marks each test in `PYTEST_CURRENT_TEST`) then keeps its server: in this
project's suite a new server per test cost about 3 CPU-s each.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from collections.abc import Callable
from multiprocessing import forkserver
from typing import Any

from shardwise.common.environment import LAUNCHER_PID

PRELOAD = (
    "shardwise.training.launch.server_signals",
    "torch._dynamo",
    "shardwise.training.launch.worker",
    "shardwise.training.trainer.loop",
)
"""What every rank imports before its first step (the trainer imports DTensor and the layouts)."""

RUNTIME_ONLY = ("SHARDWISE_", "TORCHELASTIC_", "PYTEST_CURRENT_TEST")
"""Variables (or prefixes) that nothing reads at import: shardwise's own (`SHARDWISE_FAULT`, the
launcher's pid), which a rank reads as it runs; torch elastic's, which its agent reads and sets
(it sets `TORCHELASTIC_SIGNALS_TO_HANDLE` in the launcher at its first launch); and pytest's name
of the running test. A change of these reaches the ranks without starting the server again."""

Changes = dict[str, tuple[str | None, str | None]]
"""Environment variables that changed since the server started: the value then and now (None:
unset)."""

_started_with: tuple[dict[str, str], tuple[str, ...], str] | None = None
"""The environment, `sys.path` and directory the running server started with."""


def start_method() -> str:
    """The start method for this launch's ranks: "forkserver", its server running with this
    process's `sys.path`, working directory and environment (but for `RUNTIME_ONLY` variables,
    which `forked` hands on); "spawn" where forkserver does not exist."""
    global _started_with
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    now = (dict(os.environ), tuple(sys.path), os.getcwd())
    if _started_with is None or _read_at_import(_started_with) != _read_at_import(now):
        server: Any = forkserver._forkserver
        server._stop()  # the running one, if any: its children keep running
        _started_with = None
        forkserver.set_forkserver_preload(list(PRELOAD))
        try:
            forkserver.ensure_running()
        except OSError:  # its socket's path under a long TMPDIR is over the 107 bytes allowed
            return "spawn"
        _started_with = now
    return "forkserver"


def forked(entry: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Callable[..., Any], tuple]:
    """The target and arguments of a process that runs `entry(*args)` forked from the server
    `start_method` started, in this process's environment as it is now."""
    then, now = _started_with[0] if _started_with else {}, dict(os.environ)
    changes = {
        name: (then.get(name), now.get(name))
        for name in then.keys() | now.keys()
        if then.get(name) != now.get(name)
    }
    return _in_environment, (changes, entry, *args)


def _in_environment(changes: Changes, entry: Callable[..., Any], *args: Any) -> Any:
    """In a forked rank: the launcher's changes to the environment since the server started,
    then `entry(*args)`. A variable that no longer has the server's value was set for this rank
    (torch elastic's RANK, MASTER_PORT, …) and is kept."""
    for name, (then, now) in changes.items():
        if os.environ.get(name) != then:
            continue
        if now is None:
            del os.environ[name]
        else:
            os.environ[name] = now
    return entry(*args)


def _read_at_import(
    started: tuple[dict[str, str], tuple[str, ...], str],
) -> tuple[dict[str, str], tuple[str, ...], str]:
    """What the server's imports could have read of an environment, `sys.path` and directory."""
    environment, path, directory = started
    return {k: v for k, v in environment.items() if not k.startswith(RUNTIME_ONLY)}, path, directory


def restore_sigterm() -> None:
    """In a rank of shardwise's launcher, forked from the server: SIGTERM's default action again
    (the server ignores it: server_signals.py), until the trainer installs its handler."""
    if LAUNCHER_PID in os.environ and signal.getsignal(signal.SIGTERM) == signal.SIG_IGN:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
