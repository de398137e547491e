"""Live recovery across machines (`fault.mode = "live"` with `--nnodes`): the node that hosts
the coordinator's store (launch/live_supervisor.py) decides every membership; each other
node's supervisor (`serve_node`) runs that node's replicas as it is told through the store, and
says when one ends. The coordinator sees another node's replica as a `Remote`, which behaves as
its processes would (an exit code once it ended, `kill`), so one set of rules decides for every
replica wherever it runs.

The store holds, for the other nodes: which incarnation of each slot to start (`start_key`)
or kill (`kill_key`), how each ended (`ended_key`), each node's heartbeat (`beat_key`: a count
the node raises, so that no two machines' clocks are compared) and the job's end (`END_KEY`). A
replica the coordinator kills (hung: its peers' collective failed and it did not say so) is out
of every generation at once, whether its node is there to kill it or not. A node whose count
has not moved for `NODE_LOST_S` is lost: its replicas are taken as dead, and its slots are not
restarted.

The node that hosts the coordinator is a single point of failure: when it is lost, the others
end their replicas and fail (the newest checkpoint stays, for `--resume auto`).
"""

from __future__ import annotations

import signal
import time
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any

from torch.distributed import TCPStore  # type: ignore[attr-defined]

from shardwise.common.errors import ConfigError
from shardwise.training.launch.live_processes import ReplicaFailed, Starter, ended, kill_all

NODES_KEY = "sw/nodes"
"""Each other node adds 1 here when it joins: the count it gets is its index (1, 2, ...)."""
PER_NODE_KEY = "sw/per_node"
"""The replicas each node runs, as the coordinator's node runs them."""
END_KEY = "sw/job/end"
"""The job's end, said by the coordinator: "" where it succeeded, else why it failed."""
NODE_BEAT_S = 0.2
NODE_LOST_S = 3.0
"""A node whose heartbeat has not moved for this long is lost (its machine, or its
supervisor)."""
LEAVE_S = 10.0
"""How long the coordinator waits for the other nodes to take the job's end before it closes
the store."""


def start_key(slot: int) -> str:
    return f"sw/start/{slot}"


def kill_key(slot: int) -> str:
    return f"sw/kill/{slot}"


def ended_key(slot: int, incarnation: int) -> str:
    return f"sw/ended/{slot}/{incarnation}"


def beat_key(node: int) -> str:
    return f"sw/node/{node}/beat"


def left_key(node: int) -> str:
    return f"sw/node/{node}/left"


class OtherNodes:
    """The coordinator's view of the other nodes: which owns a slot, and which are lost."""

    def __init__(self, store: Any, count: int, per_node: int) -> None:
        self.store, self.count, self.per_node = store, count, per_node
        self._seen: dict[int, tuple[bytes, float]] = {}
        store.set(PER_NODE_KEY, str(per_node))

    def of(self, slot: int) -> int:
        return slot // self.per_node

    def wait_for(self, timeout_s: float, endpoint: str) -> None:
        """Until every other node has joined (`serve_node`), at most `timeout_s`."""
        if self.count == 1:
            return
        deadline = time.monotonic() + timeout_s
        while int(self.store.add(NODES_KEY, 0)) < self.count - 1:
            if time.monotonic() > deadline:
                joined = int(self.store.add(NODES_KEY, 0)) + 1
                raise ConfigError(
                    f"{joined} of {self.count} nodes came to {endpoint} within "
                    f"{timeout_s:g} s (fault.timeout_s): start `shardwise train` on every node, "
                    "with the same --nnodes and --rdzv-endpoint"
                )
            time.sleep(0.05)

    def lost(self, node: int) -> bool:
        """Whether `node`'s heartbeat has not moved for `NODE_LOST_S`."""
        if node == 0:
            return False
        key = beat_key(node)
        beat = self.store.get(key) if self.store.check([key]) else b""
        now = time.monotonic()
        last, when = self._seen.setdefault(node, (beat, now))
        if beat != last:
            self._seen[node] = (beat, now)
            return False
        return now - when > NODE_LOST_S

    def end(self, why: str) -> None:
        """Tell the other nodes the job ended (`why` "": it succeeded), and wait, at most
        `LEAVE_S`, until each living one has taken it."""
        self.store.set(END_KEY, why)
        deadline = time.monotonic() + LEAVE_S
        for node in range(1, self.count):
            while not self.store.check([left_key(node)]) and not self.lost(node):
                if time.monotonic() > deadline:
                    return
                time.sleep(0.02)


class Remote:
    """A replica another node runs, as its processes look to the coordinator: `exitcode` once
    its node said it ended (or the node is lost: SIGKILL's), `kill`, `join`."""

    def __init__(self, nodes: OtherNodes, slot: int, incarnation: int) -> None:
        self.nodes, self.slot, self.incarnation = nodes, slot, incarnation
        self.killed = False
        nodes.store.set(start_key(slot), str(incarnation))

    @property
    def exitcode(self) -> int | None:
        store, key = self.nodes.store, ended_key(self.slot, self.incarnation)
        if store.check([key]):
            return int(store.get(key))
        # killed: out of every generation from now on, whether its node is there to kill it
        # (it does) or lost with it; a lost node's replicas are dead
        lost = self.killed or self.nodes.lost(self.nodes.of(self.slot))
        return -signal.SIGKILL if lost else None

    def kill(self) -> None:
        self.nodes.store.set(kill_key(self.slot), str(self.incarnation))
        self.killed = True

    def join(self) -> None:
        while self.exitcode is None:
            time.sleep(0.02)


def serve_node(
    endpoint: str, starter: Starter, per_node: int, *, timeout_s: float, nodes: int
) -> None:
    """Another node's supervisor: join the coordinator at `endpoint`, run this node's replicas
    (`per_node` slots) as it says, report how each ends, until it says the job ended; raise
    `ReplicaFailed` where the job failed or the coordinator is lost."""
    store, node = _join(endpoint, per_node, timeout_s=timeout_s, nodes=nodes)
    slots = range(node * per_node, (node + 1) * per_node)
    running: dict[int, tuple[int, list[Any]]] = {}
    started: dict[int, int] = {}
    beat, last_beat = 0, 0.0
    try:
        while not store.check([END_KEY]):
            if time.monotonic() - last_beat > NODE_BEAT_S:
                beat, last_beat = beat + 1, time.monotonic()
                store.set(beat_key(node), str(beat))
            _follow(store, slots, starter, running, started)
            sentinels = [p.sentinel for _, ps in running.values() for p in ps]
            if sentinels:
                wait(sentinels, timeout=0.02)
            else:
                time.sleep(0.02)
        why = store.get(END_KEY).decode()
        store.set(left_key(node), "1")
    except (RuntimeError, ConnectionError) as error:
        why = (
            f"lost the coordinator at {endpoint} (the job's first node): "
            f"{str(error).splitlines()[0]}; --resume auto continues from the newest checkpoint"
        )
    finally:
        for _, processes in running.values():
            kill_all(processes)
    if why:
        raise ReplicaFailed(-1, 1, why)


def _join(endpoint: str, per_node: int, *, timeout_s: float, nodes: int) -> tuple[Any, int]:
    """The coordinator's store, and this node's index (1, 2, ...) among the nodes."""
    host, _, port = endpoint.rpartition(":")
    try:
        store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
        store.wait([PER_NODE_KEY])
    except RuntimeError:
        raise ConfigError(
            f"the coordinator at --rdzv-endpoint {endpoint} did not answer within "
            f"{timeout_s:g} s (fault.timeout_s): start `shardwise train` on the node of that "
            f"address too, with the same --nnodes {nodes}"
        ) from None
    first = int(store.get(PER_NODE_KEY))
    if first != per_node:
        raise ConfigError(
            f"this node runs {per_node} replica(s) and the first node {first}: give every node "
            "the same --nproc"
        )
    return store, int(store.add(NODES_KEY, 1))


def _follow(
    store: Any,
    slots: range,
    starter: Starter,
    running: dict[int, tuple[int, list[Any]]],
    started: dict[int, int],
) -> None:
    """One pass: start the incarnations the coordinator asked for, kill those it asked to,
    and say how each replica that ended ended."""
    for slot in slots:
        key = start_key(slot)
        if store.check([key]) and int(store.get(key)) > started.get(slot, -1):
            if slot in running:  # its predecessor, evicted: out of every generation already
                kill_all(running.pop(slot)[1])
            started[slot] = incarnation = int(store.get(key))
            running[slot] = (incarnation, starter.start(slot, incarnation))
        key = kill_key(slot)
        if slot in running and store.check([key]) and int(store.get(key)) == running[slot][0]:
            kill_all(running[slot][1])
    for slot, (incarnation, processes) in list(running.items()):
        exitcode = ended(processes)
        if exitcode is not None:
            store.set(ended_key(slot, incarnation), str(exitcode))
            del running[slot]
