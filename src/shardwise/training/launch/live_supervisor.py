"""The coordinator of live recovery (`fault.mode = "live"`; launch/live_launch.py runs a job
on it): the processes of each data-parallel replica slot (one, or under HSDP the replica's
FSDP ranks, which live and die together), started, watched and replaced from here,
and the generations (fault/membership.py) they train in published in a store this process
owns. A replica's side is fault/live.py.

When a replica dies, the next generation leaves it out (its peers' collective failed at once;
they take that generation and do the step again); a replacement starts for its slot and, once
it says it is ready, the generation after admits it, and it heals from a member. The survivors
never restart.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any

from shardwise.training.fault.live import (
    alive_key,
    error_of,
    healed_key,
    join_key,
    saving_key,
)
from shardwise.training.fault.membership import Generation, publish
from shardwise.training.launch.forkserver import fork_target, start_method
from shardwise.training.launch.stores import LOOPBACK, host_store

HUNG_GRACE_S = 1.0
"""After a member says its collective failed, how long the others have to say so too before
the silent ones are evicted as hung (a failed collective fails every member's within
hundredths of a second: each closes its end of the group)."""


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


def supervise(
    count: int,
    target: Callable[..., None],
    args: tuple[Any, ...],
    *,
    timeout_s: float,
    restarts: int,
    min_replicas: int = 1,
    forked: bool = False,
    width: int = 1,
) -> list[Generation]:
    """Run `target(slot, local, incarnation, endpoint, *args)` (`endpoint`: this store's
    HOST:PORT) for slots 0..count-1, `width` processes each (`local` 0..width-1), until each
    ends with exit code 0; a replica one of whose processes dies (the others are killed with it)
    is dropped from the next generation and replaced (at most `restarts` times in all), its
    replacement admitted once it has said it is ready; with no restart left the others go on
    while `min_replicas` are left; `forked`: from the ranks' fork server (launch/forkserver/,
    a replacement in about a second), else spawned. The generations published, in order."""
    store = host_store(
        LOOPBACK, 0, world_size=None, timeout=timedelta(seconds=timeout_s), multi_tenant=False
    )
    replicas = _Replicas(store, target, args, restarts, min_replicas, forked=forked, width=width)
    try:
        replicas.start(count)
        while replicas.running:
            wait([p.sentinel for ps in replicas.running.values() for p in ps], timeout=0.02)
            replicas.reap()
            if replicas.finished:  # a replacement still healing would wait for ended members
                replicas.stop_unhealed()
            else:
                replicas.evict_hung()
                replicas.admit()
    except ReplicaFailed as failure:
        if not failure.config:  # a checkpoint being written is the one the job resumes from
            replicas.let_saves_finish(timeout_s)
        raise
    finally:
        replicas.kill()
    return replicas.generations


class _Replicas:
    """The replicas' processes by slot, their incarnations, and the generations published."""

    def __init__(
        self,
        store: Any,
        target: Callable[..., None],
        args: tuple[Any, ...],
        restarts: int,
        min_replicas: int,
        *,
        forked: bool,
        width: int = 1,
    ) -> None:
        self.store, self.args, self.width = store, args, width
        self.restarts, self.min_replicas = restarts, min_replicas
        method = start_method() if forked else "spawn"
        self.context: Any = multiprocessing.get_context(method)
        # forked: through the server, in this process's environment as it is now
        self.target: Callable[..., Any] = target
        self.before: tuple[Any, ...] = ()
        if method != "spawn":
            self.target, self.before = fork_target(target, ())
        self.endpoint = f"{LOOPBACK}:{store.port}"
        self.running: dict[int, list[Any]] = {}
        self.incarnations: dict[int, int] = {}
        self.members: set[int] = set()
        self.generations: list[Generation] = []
        self.finished = False
        """A replica ended its last step: its members end with it, nothing more is admitted."""
        self.reporter = 0
        self._failing_since: tuple[int, float] | None = None
        """The generation whose members first said their collective failed, and when."""

    def start(self, count: int) -> None:
        for slot in range(count):
            self._spawn(slot, 0)
        self.members = set(self.running)
        self.generations.append(publish(self.store, 0, self.members))

    def reap(self) -> None:
        """Replicas that ended: done, or dead and replaced (dropped from a new generation)."""
        for slot, processes in list(self.running.items()):
            exitcode = _ended(processes)
            if exitcode is None:
                continue
            del self.running[slot]
            if exitcode == 0:
                self.finished = True
                continue
            error = error_of(self.store, slot, self.incarnations[slot])
            said = f"replica {slot} failed: {error['message']}" if error else (
                f"replica {slot} died (exit code {exitcode})"
            )  # fmt: skip
            if error and error["config"]:  # every replica would: the job is wrong
                raise ReplicaFailed(slot, exitcode, error["message"], config=True)
            self.members.discard(slot)
            trace = error.get("traceback", "") if error else ""
            if not any(self._healed(s) for s in self.members):
                raise ReplicaFailed(
                    slot,
                    exitcode,
                    f"{said}, the last replica: none is left to heal a replacement from; "
                    "--resume auto continues from the newest checkpoint",
                    traceback=trace,
                )
            restart = sum(self.incarnations.values()) < self.restarts
            if not restart and len(self.members) < self.min_replicas:
                raise ReplicaFailed(
                    slot,
                    exitcode,
                    f"{said}; {len(self.members)} left, fewer than fault.min_replicas "
                    f"({self.min_replicas}), and no restart is left (fault.max_restarts = "
                    f"{self.restarts})",
                    traceback=trace,
                )
            self._publish()
            if restart:
                self._spawn(slot, self.incarnations[slot] + 1)

    def admit(self) -> None:
        """Replacements that said they are ready, each in a generation of its own."""
        for slot in set(self.running) - self.members:
            key = join_key(slot)
            if self.store.check([key]) and int(self.store.get(key)) == self.incarnations[slot]:
                self.members.add(slot)
                self._publish(joined=(slot,))

    def evict_hung(self) -> None:
        """Members silent while the others say their collective failed (it timed out on them:
        stopped, hung) are killed `HUNG_GRACE_S` after the first says so; their deaths are
        then reaped as any other (replaced, dropped)."""
        number = len(self.generations) - 1
        alive = {s for s in self.members if self.store.check([alive_key(number, s)])}
        if not alive:
            self._failing_since = None
            return
        now = time.monotonic()
        if self._failing_since is None or self._failing_since[0] != number:
            self._failing_since = (number, now)
        if now - self._failing_since[1] < HUNG_GRACE_S:
            return
        for slot in sorted(self.members - alive):
            for process in self.running.get(slot, []):
                if process.exitcode is None:
                    process.kill()  # reaped as a death on the next pass

    def let_saves_finish(self, timeout_s: float) -> None:
        """Wait, up to `timeout_s`, for the replicas' processes that are writing a checkpoint
        to finish it (the job is ending; the others are killed at once after)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            writing = [
                (slot, local)
                for slot, processes in self.running.items()
                for local, process in enumerate(processes)
                if process.exitcode is None and self._saving(slot, local)
            ]
            if not writing:
                return
            time.sleep(0.02)

    def _saving(self, slot: int, local: int) -> bool:
        key = saving_key(slot, local)
        return bool(self.store.check([key])) and self.store.get(key) == b"1"

    def stop_unhealed(self) -> None:
        for slot in [s for s in self.running if not self._healed(s)]:
            _kill(self.running.pop(slot))

    def kill(self) -> None:
        for processes in self.running.values():
            _kill(processes)

    def _spawn(self, slot: int, incarnation: int) -> None:
        processes = []
        for local in range(self.width):
            arguments = (*self.before, slot, local, incarnation, self.endpoint, *self.args)
            processes.append(self.context.Process(target=self.target, args=arguments))
            processes[-1].start()
        self.running[slot], self.incarnations[slot] = processes, incarnation

    def _publish(self, joined: tuple[int, ...] = ()) -> None:
        """The next generation: the members, of which `joined` and the replacements admitted
        before that have not healed yet (a member died while healing them) are new."""
        number = len(self.generations)
        unhealed = {s for s in self.members if not self._healed(s)}
        new = tuple(sorted(set(joined) | unhealed))
        if self.reporter not in self.members:  # it died: the lowest of the others that train
            self.reporter = min(self.members - unhealed)
        self.generations.append(publish(self.store, number, self.members, new, self.reporter))

    def _healed(self, slot: int) -> bool:
        """Whether the replica of `slot` trains: one the job started with, or a replacement
        that has healed."""
        incarnation = self.incarnations[slot]
        key = healed_key(slot)
        return incarnation == 0 or (
            self.store.check([key]) and int(self.store.get(key)) == incarnation
        )


def _ended(processes: list[Any]) -> int | None:
    """A replica's exit code once it has ended: 0 when all its processes ended so; that of the
    first to fail, the others then killed (they cannot go on without it); None while it runs."""
    failed = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
    if failed:
        _kill(processes)
        return int(failed[0])
    return 0 if all(p.exitcode == 0 for p in processes) else None


def _kill(processes: list[Any]) -> None:
    for process in processes:
        if process.exitcode is None:
            process.kill()
        process.join()
