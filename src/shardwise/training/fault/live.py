"""A replica's side of live recovery, on membership.py's generations and heal.py's transfer
(`fault.mode = "live"`; what the trainer calls is fault/live_replica.py). The coordinator's
side, which starts and replaces replicas and publishes the generations, is
launch/live_supervisor.py.

`LiveGroup` is a replica's process group across generations. `allreduce` sums a tensor over the
generation's members and carries one more value: whether a member has seen a newer generation
published, so that every member moves to it at the same step boundary (`boundary`) without a round
trip of its own. A collective that fails (a member died) is `recover`ed from: the next generation,
the step done again. Where a generation admits replacements, the lowest member that is not new sends
them its state before the next step (`heal.send_state`), so they start from the survivors' state."""

from __future__ import annotations

import atexit
import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from shardwise.training.fault.heal import Allocate, HealError, receive_state, send_state
from shardwise.training.fault.membership import (
    GENERATION_KEY,
    Collectives,
    Fenced,
    Generation,
    at,
    current,
    group,
    newer,
    published,
)

State = Callable[[], tuple[dict[str, torch.Tensor], dict[str, Any]]]
"""A replica's state as heal.py sends it: its tensors (received into in place) and its JSON."""


def join_key(slot: int) -> str:
    """Where a replacement of `slot` says it is ready: its incarnation."""
    return f"sw/join/{slot}"


@dataclass(frozen=True)
class Heal:
    """A heal this replica sent: to whom, from which slot, the bytes and the seconds it took."""

    to: tuple[int, ...]
    source: int
    bytes: int
    seconds: float


class Siblings:
    """The other processes of this replica (under HSDP, its FSDP ranks: the world they train
    in), which move between generations together: each has a `LiveGroup` of its own, with the
    same process of the other replicas, and these agree within the replica on every step's
    outcome and every move, so that its processes never train in different generations."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.size = dist.get_world_size()

    def sum(self, values: list[float]) -> list[float]:
        summed = torch.tensor(values, dtype=torch.float64)
        self._dist.all_reduce(summed)
        return summed.tolist()

    def max(self, value: float) -> float:
        highest = torch.tensor([value], dtype=torch.float64)  # exact for integers to 2**53
        self._dist.all_reduce(highest, op=self._dist.ReduceOp.MAX)
        return float(highest.item())

    def all(self, ok: bool) -> bool:
        """Whether every sibling's `ok` is true (and a barrier: all have come here)."""
        return self.sum([0.0 if ok else 1.0])[0] == 0


class _Newest:
    """The newest generation's number as the coordinator published it, read by a thread of its
    own every `every` seconds: a step reads this number, not the store (a round trip of 0.1 ms
    on loopback, every step)."""

    def __init__(self, host: str, port: int, timeout: timedelta, every: float = 0.02) -> None:
        self.number = -1
        self._every = every
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._poll, args=(host, port, timeout), name="shardwise-live", daemon=True
        )
        self._thread.start()
        # stopped before the interpreter ends: a thread it killed inside a store call would
        # abort the process (torch's client threads, destroyed while joinable)
        atexit.register(self.close)

    def _poll(self, host: str, port: int, timeout: timedelta) -> None:
        store = TCPStore(host, port, is_master=False, timeout=timeout)
        while not self._stop.wait(self._every):
            try:
                if store.check([GENERATION_KEY]):
                    self.number = published(store)
            except RuntimeError:  # the coordinator's store is gone: the job is ending
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def alive_key(generation: int, slot: int) -> str:
    """Where a member whose collective in `generation` failed says it is alive (`recover`)."""
    return f"sw/g{generation}/alive/{slot}"


def formed_key(generation: int, slot: int) -> str:
    """Where a member says it formed `generation`'s group: one that admits a replacement is
    published only then, so that no member forms a generation the others have passed over."""
    return f"sw/g{generation}/formed/{slot}"


def error_key(slot: int, incarnation: int) -> str:
    """Where a replica says the error it ended on (`LiveGroup.failed`)."""
    return f"sw/error/{slot}/{incarnation}"


def error_of(store: Any, slot: int, incarnation: int) -> dict[str, Any] | None:
    """The error a replica said it ended on: {"message": one line, "config": whether the job
    itself is wrong}; None where it said none (it was killed)."""
    key = error_key(slot, incarnation)
    return json.loads(store.get(key)) if store.check([key]) else None


def saving_key(slot: int, local: int) -> str:
    """Where a replica's process says it is writing a checkpoint ("1") or not ("0")."""
    return f"sw/saving/{slot}/{local}"


def work_key(slot: int) -> str:
    """Where a replica says its own work per step (`LiveGroup.work`)."""
    return f"sw/work/{slot}"


def healed_key(slot: int) -> str:
    """Where a replacement of `slot` says it has healed and trains: its incarnation."""
    return f"sw/healed/{slot}"


class LiveGroup:
    """A replica's process group across generations (module docstring)."""

    def __init__(
        self,
        endpoint: str,
        slot: int,
        incarnation: int,
        timeout_s: float,
        *,
        local: int = 0,
        siblings: Siblings | None = None,
    ) -> None:
        """`endpoint`: the coordinator's store, HOST:PORT; `incarnation` 0 for the replicas a
        job starts with, then 1, 2, … for each replacement of the slot (it must `join`);
        `local`: which of the replica's processes this is, its `siblings` the others (none:
        a replica of one process)."""
        host, _, port = endpoint.rpartition(":")
        timeout = timedelta(seconds=timeout_s)
        self.store = TCPStore(host, int(port), is_master=False, timeout=timeout)
        self.slot = slot
        self.incarnation = incarnation
        self.local = local
        self.siblings = siblings
        self.timeout_s = timeout_s
        self.generation: Generation | None = None
        self.pg: Collectives | None = None
        self._switch = False
        self.healed: Heal | None = None
        """The last heal this replica sent (live_replica.py reports it, then clears it)."""
        self.committed = -1
        """The last step this member committed (-1: none, as a replacement that has not healed):
        the trainer's replica keeps it; a generation's members heal to the highest."""
        self.behind: tuple[int, ...] = ()
        """The members the last generation moved into healed (every member knows them: each
        compares its state's hash with theirs then)."""
        self.received_from: int | None = None
        """The slot this member last received its state from (a heal: the trainer's replica
        reports it, then clears it)."""
        self.hook: Callable[[str], None] = lambda point: None
        """Called at points of a membership change (`reform`, `heal_send`, `heal_receive`):
        where fault injection kills a replica (fault/inject.py)."""
        if incarnation == 0:  # the job's first generation (none of it is new: no state moves)
            self._move(current(self.store, timeout_s), lambda: ({}, {}))
        self._newest = _Newest(host, int(port), timeout)

    def join(self, state: State, allocate: Allocate | None = None) -> dict[str, Any]:
        """A replacement's start: say it is ready, wait for the generation that admits it, and
        receive a member's state into `state`'s tensors (and those `allocate` makes:
        heal.receive_state); that state's JSON."""
        if self.siblings is not None:
            self.siblings.all(True)  # every process of the replica built: it is ready
        self.store.set(join_key(self.slot), str(self.incarnation))
        seen = -1
        while True:
            generation = newer(self.store, seen, self.timeout_s)
            if self.slot in generation.joined:
                extra = self._move(generation, state, allocate)
                self.store.set(healed_key(self.slot), str(self.incarnation))
                return extra
            seen = generation.number

    def allreduce(self, tensor: torch.Tensor) -> bool:
        """Sum `tensor` over the members, in place. False where a member died: `recover`, then
        do the step again."""
        buffer = torch.cat([tensor.detach().flatten(), tensor.new_zeros(1)])
        if not self.allreduce_in_place(buffer):
            return False
        tensor.copy_(buffer[:-1].view_as(tensor))
        return True

    def allreduce_in_place(self, buffer: torch.Tensor) -> bool:
        """`allreduce` of a flat `buffer` whose last element is this call's own (whether a
        member has seen a newer generation); False where a member died, the buffer's values
        then lost."""
        assert self.generation is not None, "join first"
        assert self.pg is not None
        buffer[-1] = 1.0 if self._newest.number > self.generation.number else 0.0
        try:
            self.pg.allreduce([buffer]).wait()
        except RuntimeError:
            return False
        self._switch = bool(buffer[-1] > 0)
        return True

    def settle(self, ok: bool, values: tuple[float, ...] = ()) -> tuple[bool, list[float]]:
        """After a collective: whether it succeeded on every sibling (where one failed, this
        one's group is closed too and all `recover` together), every sibling then moving at
        the boundary where any saw a newer generation; and `values` summed over the siblings."""
        if self.siblings is None:
            return ok, list(values)
        failed, switch, *summed = self.siblings.sum([float(not ok), float(self._switch), *values])
        self._switch = switch > 0
        return failed == 0, summed

    def wait_for_more(self, state: State, allocate: Allocate | None = None) -> dict[str, Any]:
        """The next generation (healing the members behind), waited for up to the timeout; the
        JSON this member received where it was behind, else {}."""
        assert self.generation is not None
        following = newer(self.store, self.generation.number, self.timeout_s)
        return self._move(following, state, allocate)

    def work(self, seconds: float) -> dict[int, float]:
        """Say this replica's own work per step (its first process does), and read every
        member's as each last said it, by slot (those that have not said yet left out): the
        replicas' straggler check, off any process group (fault/health.py)."""
        if self.local == 0:
            self.store.set(work_key(self.slot), repr(seconds))
        assert self.generation is not None
        slots = list(self.generation.slots)
        said = [s for s in slots if self.store.check([work_key(s)])]
        values = self.store.multi_get([work_key(s) for s in said]) if said else []
        return {s: float(v) for s, v in zip(said, values, strict=True)}

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """While this process writes a checkpoint: a job the supervisor ends meanwhile (too
        few replicas left) waits for the write to finish before it kills the process."""
        self.store.set(saving_key(self.slot, self.local), "1")
        try:
            yield
        finally:
            self.store.set(saving_key(self.slot, self.local), "0")

    def failed(self, message: str, *, config: bool, traceback: str = "") -> None:
        """Say the error this replica ends on, for the coordinator to report (`config`: the
        job is wrong, and no replacement would fare better; `traceback`: where it came from)."""
        described = json.dumps({"message": message, "config": config, "traceback": traceback})
        self.store.set(error_key(self.slot, self.incarnation), described)

    def close(self) -> None:
        self._newest.close()

    def boundary(self, state: State, allocate: Allocate | None = None) -> dict[str, Any]:
        """Between two steps: where a member saw a newer generation, every member moves to the
        newest now (healing the members behind); the JSON this member received where it was
        behind, else {}."""
        if not self._switch:
            return {}
        self._switch = False
        return self._move(current(self.store, self.timeout_s), state, allocate)

    def recover(self, state: State, allocate: Allocate | None = None) -> dict[str, Any]:
        """After a failed collective: the next generation (healing the members behind); the
        JSON this member received where it was behind (its peers had committed a step its own
        collective failed in), else {}."""
        assert self.generation is not None
        # This replica's end of the broken group closed now: a peer still waiting on it inside
        # the same collective fails at once too, rather than at gloo's timeout.
        self.pg = None
        # ... and said alive: the coordinator evicts the members that do not say so (hung)
        self.store.set(alive_key(self.generation.number, self.slot), str(self.incarnation))
        following = newer(self.store, self.generation.number, self.timeout_s)
        return self._move(following, state, allocate)

    @property
    def width(self) -> int:
        """The replica's processes: this one and its siblings."""
        return 1 if self.siblings is None else self.siblings.size

    @property
    def size(self) -> int:
        assert self.generation is not None
        return len(self.generation.slots)

    @property
    def rank(self) -> int:
        """This replica's rank in its generation (0: the lowest live slot)."""
        assert self.generation is not None
        return self.generation.rank_of(self.slot)

    def _move(
        self, generation: Generation, state: State, allocate: Allocate | None = None
    ) -> dict[str, Any]:
        """Into `generation` (with siblings: the newest any of them came to), healing the
        members behind (this one's: the JSON it was sent); where its group does not form or a
        heal breaks (a member died or hangs meanwhile), here or at a sibling, on into the
        next one."""
        while True:
            if self.siblings is not None:
                highest = int(self.siblings.max(generation.number))
                generation = generation if highest == generation.number else at(self.store, highest)
            self.generation, self.pg = generation, None
            extra: dict[str, Any] = {}
            try:
                self.hook("reform")
                self.pg = group(self.store, generation, self.slot, self.timeout_s, self.local)
                extra, ok = self._heal(generation, state, allocate), True
            except (Fenced, HealError):
                raise
            except RuntimeError:
                ok = False
            ok, _ = self.settle(ok)
            if ok:
                if self.local == 0:  # the coordinator admits no one until every member has
                    self.store.set(formed_key(generation.number, self.slot), "1")
                return extra
            self.pg = None  # closed: the members still in it fail at once too
            self.store.set(alive_key(generation.number, self.slot), str(self.incarnation))
            generation = newer(self.store, generation.number, self.timeout_s)

    def _heal(
        self, generation: Generation, state: State, allocate: Allocate | None
    ) -> dict[str, Any]:
        """The members behind the highest step committed receive the state of the lowest
        member at it: the replacements, and a member whose collective failed where its peers'
        completed (gloo's ring can leave one so when a peer dies inside it), which would
        otherwise do again a step they had committed."""
        assert self.pg is not None
        steps = self._committed_steps(generation)
        top = max(steps.values())
        behind = self.behind = tuple(slot for slot in generation.slots if steps[slot] < top)
        if not behind:
            return {}
        source = min(slot for slot in generation.slots if steps[slot] == top)
        if self.slot == source:
            began = time.perf_counter()
            tensors, extra = state()
            sent = 0
            for slot in behind:
                self.hook("heal_send")
                sent += send_state(self.pg, generation.rank_of(slot), tensors, extra)
            self.healed = Heal(behind, source, sent, time.perf_counter() - began)
        elif self.slot in behind:
            if self.slot in generation.joined:
                self.hook("heal_receive")
            extra = receive_state(self.pg, generation.rank_of(source), state()[0], allocate)
            self.received_from, self.committed = source, top
            return extra
        return {}

    def _committed_steps(self, generation: Generation) -> dict[int, int]:
        """Each member's last committed step, by slot (one all-reduce: each adds its own at its
        rank); a replacement admitted now counts as none."""
        assert self.pg is not None
        steps = torch.zeros(len(generation.slots), dtype=torch.float64)
        mine = -1 if self.slot in generation.joined else self.committed
        steps[generation.rank_of(self.slot)] = mine + 1  # float64: exact to 2**53
        self.pg.allreduce([steps]).wait()
        return {slot: int(steps[generation.rank_of(slot)].item()) - 1 for slot in generation.slots}
