"""Workers forked from a server that has imported torch and the trainer once.

A spawned rank is a new interpreter that imports torch, DTensor, torch._dynamo (which
DistributedDataParallel imports) and the trainer before it does anything, again in every rank of
every launch and restart. multiprocessing's forkserver pays it once: the server imports
`PRELOAD` when it starts and forks each rank from that state (what it saves: docs/benchmarks.md,
"Launch costs").

The server imports modules only, and initialises neither CUDA nor OpenMP's thread pool, so the
forked ranks start as spawned ones do. It is a new interpreter (started by exec, as
multiprocessing does), except under a `shardwise` command on a CPU-only build of torch, where
the launcher forks it from itself before it checks the job or starts its agent
(`_fork_server`): the server then starts with torch imported instead of importing it again.

A rank sees the launching process's environment, `sys.path` and working directory, as a spawned
one does. multiprocessing hands each forked child the last two; the environment is the server's,
from when it started, so a rank first applies what has changed in the launcher since
(`fork_target`). What the server imported may have read the environment, though (torch reads
`TORCH_*` variables as it imports, numpy its BLAS settings), so when a variable changes, or
`sys.path` or the directory, the server is started again, unless the variable is one that is
read only as a rank runs (`RUNTIME_ONLY`). A Python caller that launches many times (a sweep, a
test suite: pytest marks each test in `PYTEST_CURRENT_TEST`) then keeps its server.
"""

from __future__ import annotations

import gc
import importlib
import multiprocessing
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from multiprocessing import connection, forkserver, resource_tracker
from typing import Any

from shardwise.common.environment import LAUNCHER_PID

PRELOAD = (
    "shardwise.training.launch.forkserver.signals",
    "torch._dynamo",
    "shardwise.training.launch.worker",
    "shardwise.training.trainer.loop",
    "shardwise.training.launch.forkserver.freeze",
)
"""What every rank imports before its first step (the trainer imports DTensor and the layouts),
then the freeze of it all (freeze.py: a rank's garbage collections leave it alone)."""

RUNTIME_ONLY = (
    "SHARDWISE_",
    "TORCHELASTIC_",
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
    "GLOO_SOCKET_IFNAME",
    "NCCL_SOCKET_IFNAME",
    "PYTEST_CURRENT_TEST",
)
"""Variables (or prefixes) that nothing reads at import: shardwise's own (`SHARDWISE_FAULT`, the
launcher's pid), which a rank reads as it runs; torch elastic's, which its agent reads and sets
(it sets `TORCHELASTIC_SIGNALS_TO_HANDLE` in the launcher at its first launch); those the
launcher sets for its ranks' rendezvous and collectives (agent.py, stores.py), read when they
meet; and pytest's name of the running test. A change of these reaches the ranks without
starting the server again."""

Changes = dict[str, tuple[str | None, str | None]]
"""Environment variables that changed since the server started: the value then and now (None:
unset)."""

_started_with: tuple[dict[str, str], tuple[str, ...], str] | None = None
"""The environment, `sys.path` and directory the running server started with."""


OPT_OUT = "SHARDWISE_FORKSERVER"
"""`SHARDWISE_FORKSERVER=0` starts every rank by spawn (no server)."""


def start_method() -> str:
    """The start method for this launch's ranks: "forkserver", its server running with this
    process's `sys.path`, working directory and environment (but for `RUNTIME_ONLY` variables,
    which `fork_target` hands on); "spawn" where forkserver does not exist, where `OPT_OUT` says so,
    or where multiprocessing's server is not the one this module knows (`known_server`)."""
    global _started_with
    if (
        "forkserver" not in multiprocessing.get_all_start_methods()
        or os.environ.get(OPT_OUT, "1") == "0"
        or not known_server()
    ):
        return "spawn"
    now = (dict(os.environ), tuple(sys.path), os.getcwd())
    if _started_with is None or _read_at_import(_started_with) != _read_at_import(now):
        server: Any = forkserver._forkserver
        server._stop()  # the running one, if any: its children keep running
        _started_with = None
        forkserver.set_forkserver_preload(list(PRELOAD))
        try:
            if not _fork_server(server):
                forkserver.ensure_running()
        except OSError:  # its socket's path under a long TMPDIR is over the 107 bytes allowed
            return "spawn"
        _started_with = now
    return "forkserver"


_SERVER_FIELDS = frozenset(
    {
        "_forkserver_address",
        "_forkserver_alive_fd",
        "_forkserver_pid",
        "_inherited_fds",
        "_lock",
        "_preload_modules",
    }
)
"""The state of multiprocessing's ForkServer (Python 3.11) that `_fork_server` sets as its
`ensure_running` does; a Python whose server holds anything else (an authentication key) spawns
its ranks (`known_server`)."""


def known_server() -> bool:
    """Whether multiprocessing's ForkServer holds the fields this module sets and calls
    (Python 3.11's, `_SERVER_FIELDS`, and its `_stop`): another Python's may hold others (an
    authentication key) or name them otherwise, and its ranks are spawned instead."""
    server: Any = forkserver._forkserver
    return set(vars(server)) == _SERVER_FIELDS and callable(getattr(server, "_stop", None))


_may_fork = False
"""Whether this process may fork the server from itself (`fork_servers_from_this_process`)."""


def fork_servers_from_this_process() -> None:
    """Let `start_method` fork the server from this process instead of starting a new
    interpreter, for `shardwise` commands: the process is shardwise's own, and its launcher
    starts the server before it runs anything of the job (local.train: a Delta table's check
    starts deltalake's runtime, which panics in a forked process). The forked server starts
    with torch imported, not importing it again. A Python caller (a notebook, a test suite, a
    Ray actor) keeps the exec'd server: its threads could hold a lock that a fork copies held."""
    global _may_fork
    _may_fork = True


_unused: int | None = None
"""The pid of a server `_fork_server` forked that no rank has been forked from yet."""


def discard_unused_server() -> None:
    """Stop the server this process forked for a launch refused before it began (a job that
    fails its checks): killed, not left to import the trainer for nothing on the cores the
    refusal's message waits on)."""
    global _started_with, _unused
    server: Any = forkserver._forkserver
    if _unused is None or server._forkserver_pid != _unused:
        return
    os.kill(_unused, signal.SIGKILL)
    server._stop()  # closes its pipe, reaps it, removes its socket
    _started_with = _unused = None


def _fork_server(server: Any) -> bool:
    """Start multiprocessing's fork server as a fork of this process, as its `ensure_running`
    would by exec, where `fork_servers_from_this_process` allowed it, torch is imported and is a
    CPU-only build (a GPU build's launcher may have asked the driver for its devices, which a
    forked rank's CUDA would inherit broken), and this process has one thread of Python. The
    child holds what an exec'd server would (the listening socket and the pipe that ends it, no
    other descriptor; SIGTERM ignored as signals.py does; multiprocessing gives each rank
    the launcher's `sys.argv` and `__main__` in either case), then imports `PRELOAD`, freezes
    what it holds (freeze.py, whose import alone would not where this process had
    imported it already) and serves.
    False where it cannot: the caller starts one by exec."""
    global _unused
    torch = sys.modules.get("torch")
    if (
        not _may_fork
        or torch is None
        or torch.version.cuda is not None  # a GPU build: nothing may touch CUDA before a fork
        or torch.version.hip is not None
        or threading.active_count() > 1
        or "fork" not in multiprocessing.get_all_start_methods()
    ):
        return False
    with server._lock:
        resource_tracker.ensure_running()
        with socket.socket(socket.AF_UNIX) as listener:
            address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
            listener.bind(address)
            os.chmod(address, 0o600)
            listener.listen()
            alive_r, alive_w = os.pipe()
            for stream in (sys.stdout, sys.stderr):  # or the ranks would print it again
                stream.flush()
            pid = os.fork()
            if pid == 0:  # the server: what an exec'd one would hold, then its loop
                try:
                    keep = sorted((listener.fileno(), alive_r))
                    os.closerange(3, keep[0])
                    os.closerange(keep[0] + 1, keep[1])
                    os.closerange(keep[1] + 1, os.sysconf("SC_OPEN_MAX"))
                    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # signals.py
                    signal.signal(signal.SIGINT, signal.default_int_handler)  # for the ranks
                    for name in server._preload_modules:
                        importlib.import_module(name)
                    gc.freeze()
                    forkserver.main(listener.fileno(), alive_r, server._preload_modules)
                finally:
                    os._exit(0)
            os.close(alive_r)
        server._forkserver_address = address
        server._forkserver_alive_fd = alive_w
        server._forkserver_pid = pid
    _unused = pid
    return True


def fork_target(
    entry: Callable[..., Any], args: tuple[Any, ...]
) -> tuple[Callable[..., Any], tuple]:
    """The target and arguments of a process that runs `entry(*args)` forked from the server
    `start_method` started, in this process's environment as it is now."""
    global _unused
    _unused = None
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
    (the server ignores it: signals.py), until the trainer installs its handler."""
    if LAUNCHER_PID in os.environ and signal.getsignal(signal.SIGTERM) == signal.SIG_IGN:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
