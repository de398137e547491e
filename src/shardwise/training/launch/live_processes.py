"""A live replica's processes on this machine (`fault.mode = "live"`): started together (one,
or under HSDP and tensor parallelism the replica's ranks), ended together, and the error that
ends a job. The coordinator (launch/live_supervisor.py) runs them for its own node, and each
other node's supervisor (launch/live_nodes.py) for its."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any

from shardwise.training.launch.forkserver import fork_target, start_method


class ReplicaFailed(RuntimeError):
    """The job cannot go on: replicas died and too few are left with no restart left
    (`fault.max_restarts`, `fault.min_replicas`), or one found the job itself wrong (`config`)."""

    def __init__(
        self, slot: int, exitcode: int, why: str, *, config: bool = False, traceback: str = ""
    ) -> None:
        super().__init__(why)
        self.slot, self.exitcode, self.config = slot, exitcode, config
        self.traceback = traceback
        """Where the replica's own error came from (none where it was killed)."""


class Starter:
    """Starts the `width` processes of a replica: `target(slot, local, incarnation, endpoint,
    *args)`, forked from the ranks' server (launch/forkserver/, a replacement in about a
    second), else spawned."""

    def __init__(
        self,
        target: Callable[..., None],
        args: tuple[Any, ...],
        endpoint: str = "",
        *,
        forked: bool,
        width: int,
    ) -> None:
        self.args, self.width = args, width
        self.endpoint = endpoint
        """The coordinator's store (HOST:PORT), once it runs: a server forked from a process
        that runs one already starts processes that cannot read their arguments (Bad file
        descriptor), so the coordinator makes its `Starter` first."""
        method = start_method() if forked else "spawn"
        self.context: Any = multiprocessing.get_context(method)
        # forked: through the server, in this process's environment as it is now
        self.target: Callable[..., Any] = target
        self.before: tuple[Any, ...] = ()
        if method != "spawn":
            self.target, self.before = fork_target(target, ())

    def start(self, slot: int, incarnation: int) -> list[Any]:
        processes = []
        for local in range(self.width):
            arguments = (*self.before, slot, local, incarnation, self.endpoint, *self.args)
            processes.append(self.context.Process(target=self.target, args=arguments))
            processes[-1].start()
        return processes


def ended(processes: list[Any]) -> int | None:
    """A replica's exit code once it has ended: 0 when all its processes ended so; that of the
    first to fail, the others then killed (they cannot go on without it); None while it runs."""
    failed = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
    if failed:
        kill_all(processes)
        return int(failed[0])
    return 0 if all(p.exitcode == 0 for p in processes) else None


def kill_all(processes: list[Any]) -> None:
    for process in processes:
        if process.exitcode is None:
            process.kill()
        process.join()
