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

import socket
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any

from shardwise.training.fault.live import (
    alive_key,
    error_of,
    formed_key,
    healed_key,
    join_key,
    saving_key,
)
from shardwise.training.fault.membership import Generation, publish
from shardwise.training.launch.live_nodes import OtherNodes, Remote
from shardwise.training.launch.live_processes import ReplicaFailed, Starter, ended, kill_all
from shardwise.training.launch.stores import LOOPBACK, host_store

HUNG_GRACE_S = 1.0
"""After a member says its collective failed, how long the others have to say so too before
the silent ones are evicted as hung (a failed collective fails every member's within
hundredths of a second: each closes its end of the group)."""


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
    nodes: int = 1,
    host: str = LOOPBACK,
    port: int = 0,
) -> list[Generation]:
    """Run `target(slot, local, incarnation, endpoint, *args)` (`endpoint`: this store's
    HOST:PORT) for slots 0..count-1, `width` processes each (`local` 0..width-1), until each
    ends with exit code 0; a replica one of whose processes dies (the others are killed with it)
    is dropped from the next generation and replaced (at most `restarts` times in all), its
    replacement admitted once it has said it is ready; with no restart left the others go on
    while `min_replicas` are left; `forked`: from the ranks' fork server (launch/forkserver/,
    a replacement in about a second), else spawned. Across `nodes` machines this one runs the
    first count / nodes slots and hosts the store on `host`:`port`; the others' supervisors
    (launch/live_nodes.py) join it there and run theirs. The generations published, in order."""
    # the ranks' server before the store (started again where the environment changed since)
    starter = Starter(target, args, forked=forked, width=width)
    store = host_store(
        host, port, world_size=None, timeout=timedelta(seconds=timeout_s), multi_tenant=False
    )
    endpoint = starter.endpoint = f"{socket.gethostbyname(host)}:{store.port}"
    others = OtherNodes(store, nodes, count // nodes)
    replicas = _Replicas(store, starter, others, restarts, min_replicas)
    why = "the job's first node ended"
    try:
        others.wait_for(timeout_s, endpoint)
        replicas.start(count)
        while replicas.running:
            processes = [p for ps in replicas.running.values() for p in ps]
            wait([p.sentinel for p in processes if not isinstance(p, Remote)], timeout=0.02)
            replicas.reap()
            if replicas.finished:  # a replacement still healing would wait for ended members
                replicas.stop_unhealed()
            else:
                replicas.evict_hung()
                replicas.admit()
        why = ""
    except ReplicaFailed as failure:
        why = str(failure)
        if not failure.config:  # a checkpoint being written is the one the job resumes from
            replicas.let_saves_finish(timeout_s)
        raise
    finally:
        replicas.kill()
        others.end(why)
    return replicas.generations


class _Replicas:
    """The replicas' processes by slot, their incarnations, and the generations published."""

    def __init__(
        self, store: Any, starter: Starter, nodes: OtherNodes, restarts: int, min_replicas: int
    ) -> None:
        self.store, self.starter, self.nodes = store, starter, nodes
        self.restarts, self.min_replicas = restarts, min_replicas
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
        """Replicas that ended: done, or dead and replaced (dropped from a new generation: one
        for all that ended together, as a lost machine's do)."""
        restarts: list[int] = []
        for slot, processes in list(self.running.items()):
            exitcode = ended(processes)
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
            # a lost node's slots are not restarted: nothing is left there to start them
            restart = sum(self.incarnations.values()) + len(restarts) < self.restarts
            restart = restart and not self.nodes.lost(self.nodes.of(slot))
            if not restart and len(self.members) < self.min_replicas:
                raise ReplicaFailed(
                    slot,
                    exitcode,
                    f"{said}; {len(self.members)} left, fewer than fault.min_replicas "
                    f"({self.min_replicas}), and no restart is left (fault.max_restarts = "
                    f"{self.restarts})",
                    traceback=trace,
                )
            restarts += [slot] if restart else []
        if set(self.generations[-1].slots) != self.members:
            self._publish()
        for slot in restarts:
            self._spawn(slot, self.incarnations[slot] + 1)

    def admit(self) -> None:
        """Replacements that said they are ready, in one generation, once every member has
        formed the newest: two published in a row could be taken apart (a member still forming
        the first would wait for the others, gone on to the second, until its formation timed
        out)."""
        number = len(self.generations) - 1
        if not all(self.store.check([formed_key(number, s)]) for s in self.members):
            return
        ready = []
        for slot in sorted(set(self.running) - self.members):
            key = join_key(slot)
            if self.store.check([key]) and int(self.store.get(key)) == self.incarnations[slot]:
                ready.append(slot)
        if ready:
            self.members.update(ready)
            self._publish(joined=tuple(ready))

    def evict_hung(self) -> None:
        """Members silent while the others say their collective failed (it timed out on them:
        stopped, hung) are killed `HUNG_GRACE_S` after the first says so; their deaths are
        then reaped as any other (replaced, dropped). Where every member says so (one stalled
        past the timeout and woke), the same members form the next generation."""
        number = len(self.generations) - 1
        alive = {s for s in self.members if self.store.check([alive_key(number, s)])}
        if not alive:
            self._failing_since = None
            return
        if alive == self.members:
            self._publish()
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
                for local in range(self.starter.width)
                if any(p.exitcode is None for p in processes) and self._saving(slot, local)
            ]
            if not writing:
                return
            time.sleep(0.02)

    def _saving(self, slot: int, local: int) -> bool:
        key = saving_key(slot, local)
        return bool(self.store.check([key])) and self.store.get(key) == b"1"

    def stop_unhealed(self) -> None:
        for slot in [s for s in self.running if not self._healed(s)]:
            kill_all(self.running.pop(slot))

    def kill(self) -> None:
        for processes in self.running.values():
            kill_all(processes)

    def _spawn(self, slot: int, incarnation: int) -> None:
        if self.nodes.of(slot) == 0:
            self.running[slot] = self.starter.start(slot, incarnation)
        else:  # its node's supervisor starts it
            self.running[slot] = [Remote(self.nodes, slot, incarnation)]
        self.incarnations[slot] = incarnation

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
