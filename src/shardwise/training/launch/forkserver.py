"""Workers forked from a server that has imported torch and the trainer once.

A spawned rank is a new interpreter that imports torch, DTensor, torch._dynamo (which
DistributedDataParallel imports) and the trainer before it does anything: about 4 s of CPU per
rank on the development machine, paid again by every rank of every launch and restart.
multiprocessing's forkserver pays it once: the server imports `PRELOAD` when it starts and forks
each rank from that state. A 2-rank digits run of 4 steps took 10.5 CPU-s and 8.5 s with spawned
ranks, 7.4 CPU-s and 6.1 s with forked ones; a node of 8 ranks saves 7 imports per launch.

The server is a clean process (started by exec, not forked from the launcher, whose threads it does
not inherit); it imports modules only, and initialises neither CUDA nor OpenMP's thread pool, so
the forked ranks start as spawned ones do. Its children inherit the environment, `sys.path` and
working directory it was started with: when one has changed since (a Python caller that launches
twice with different variables, or from another directory), the server is started again, so a
rank always sees the launching process's, as a spawned one does.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
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

_started_with: tuple[dict[str, str], tuple[str, ...], str] | None = None


def start_method() -> str:
    """The start method for this launch's ranks: "forkserver", its server running with this
    process's current environment, `sys.path` and working directory; "spawn" where forkserver
    does not exist."""
    global _started_with
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    wanted = (dict(os.environ), tuple(sys.path), os.getcwd())
    if _started_with != wanted:
        server: Any = forkserver._forkserver
        server._stop()  # the running one, if any: its children keep running
        _started_with = None
        forkserver.set_forkserver_preload(list(PRELOAD))
        try:
            forkserver.ensure_running()
        except OSError:  # its socket's path under a long TMPDIR is over the 107 bytes allowed
            return "spawn"
        _started_with = wanted
    return "forkserver"


def restore_sigterm() -> None:
    """In a rank of shardwise's launcher, forked from the server: SIGTERM's default action again
    (the server ignores it: server_signals.py), until the trainer installs its handler."""
    if LAUNCHER_PID in os.environ and signal.getsignal(signal.SIGTERM) == signal.SIG_IGN:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
