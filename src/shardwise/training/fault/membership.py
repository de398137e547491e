"""Membership of a job's data-parallel replicas by generation: the ground of live recovery
(`fault.mode = "live"`).

A coordinator (the process that supervises the replicas) owns a TCPStore. It publishes each
generation, a number and the slots of the replicas that belong to it, with `publish`; every
replica reads the newest with `current` and builds that generation's process group with `group`:
a gloo group of its own on a `PrefixStore` of the generation, its ranks in slot order. torch 2.13
cannot shrink a gloo group: a new membership is a new group (a few hundredths of a second for a
few ranks). When a replica dies, its peers' collectives on the old group fail at once; each
waits for the coordinator's next generation (`newer`) and goes on in it. A replica whose slot is
not in the newest generation has been replaced: `group` raises `Fenced`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol, cast

import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, Store  # type: ignore[attr-defined]

GENERATION_KEY = "sw/generation"


class Collectives(Protocol):
    """What live recovery calls on a generation's gloo group (torch's stubs do not type it)."""

    def allreduce(self, tensors: list[torch.Tensor]) -> Any: ...

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any: ...

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any: ...


class Fenced(RuntimeError):
    """This replica's slot is not in the newest generation: another took its place."""


@dataclass(frozen=True)
class Generation:
    number: int
    slots: tuple[int, ...]
    """The live replicas' slots, in rank order."""
    joined: tuple[int, ...] = ()
    """Slots new in this generation: replacements that heal from a member before its first step."""
    reporter: int = 0
    """The slot that reports the run (metrics, MLflow, the summary): the job's first replica
    until it dies, then the lowest of those left; never a replacement."""

    def rank_of(self, slot: int) -> int:
        if slot not in self.slots:
            raise Fenced(f"slot {slot} is not in generation {self.number} {list(self.slots)}")
        return self.slots.index(slot)


def publish(
    store: Store,
    number: int,
    slots: list[int] | tuple[int, ...] | set[int],
    joined: tuple[int, ...] = (),
    reporter: int = 0,
) -> Generation:
    """The coordinator's: generation `number` with the replicas `slots`, of which `joined` are
    new, `reporter` reporting (its slots first, then its number, so that a replica that sees
    the number finds them)."""
    generation = Generation(number, tuple(sorted(slots)), tuple(sorted(joined)), reporter)
    described = {
        "slots": list(generation.slots),
        "joined": list(generation.joined),
        "reporter": reporter,
    }
    store.set(_slots_key(number), json.dumps(described))
    store.set(GENERATION_KEY, str(number))
    return generation


def current(store: Store, timeout_s: float) -> Generation:
    """The newest generation, waiting up to `timeout_s` for the first."""
    store.wait([GENERATION_KEY], timedelta(seconds=timeout_s))
    return at(store, int(store.get(GENERATION_KEY)))


def at(store: Store, number: int) -> Generation:
    """Generation `number`, published (a sibling process of the replica has seen it)."""
    described = json.loads(store.get(_slots_key(number)))
    return Generation(
        number, tuple(described["slots"]), tuple(described["joined"]), described["reporter"]
    )


def newer(store: Store, than: int, timeout_s: float) -> Generation:
    """The newest generation once there is one after `than`, waiting up to `timeout_s`."""
    store.wait([_slots_key(than + 1)], timedelta(seconds=timeout_s))
    deadline = time.monotonic() + timeout_s
    while (found := current(store, timeout_s)).number <= than:  # its number comes next
        if time.monotonic() > deadline:
            raise TimeoutError(f"generation {than + 1} has slots but was never published")
        time.sleep(0.001)
    return found


FORM_S = 10.0
"""How long a generation's members wait for each other to form its group. They come to it
together (a collective that failed on all of them, or the same step boundary), so a member
missing after this died or hangs meanwhile: `FormationFailed`, and the next generation."""


class FormationFailed(RuntimeError):
    """A member of the generation never came to form its group."""


def group(
    store: Store, generation: Generation, slot: int, timeout_s: float, local: int = 0
) -> Collectives:
    """This replica's gloo group in `generation` (`Fenced` where its slot is not in it;
    `FormationFailed` where a member does not come within `FORM_S`); collectives on it fail
    after `timeout_s` where a peer neither answers nor dies. `local`: which of the replica's
    processes (under HSDP, its FSDP rank: the group joins that rank of every replica)."""
    rank = generation.rank_of(slot)
    prefix = PrefixStore(f"sw/g{generation.number}/group/{local}/", store)
    forming = timedelta(seconds=min(FORM_S, timeout_s))
    prefix.set_timeout(forming)
    try:
        made = ProcessGroupGloo(prefix, rank, len(generation.slots), forming)
    except RuntimeError as e:
        raise FormationFailed(
            f"generation {generation.number}'s group did not form: {str(e).splitlines()[0]}"
        ) from None
    made._set_default_timeout(timedelta(seconds=timeout_s))
    return cast(Collectives, made)


def published(store: Store) -> int:
    """The newest generation's number, once there is one: one read of the store (a member asks
    at every step)."""
    return int(store.get(GENERATION_KEY))


def _slots_key(number: int) -> str:
    return f"sw/g{number}/slots"
