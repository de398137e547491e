"""The coordinator of live recovery (issue 59, being built; no run uses it yet): one process per
data-parallel replica slot, started, watched and replaced from here, and the generations
(fault/membership.py) they train in published in a store this process owns. A replica's side is
fault/live.py.

When a replica dies, the next generation leaves it out (its peers' collective failed at once;
they take that generation and do the step again); a replacement starts for its slot and, once
it says it is ready, the generation after admits it, and it heals from a member. The survivors
never restart.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any

from shardwise.training.fault.live import join_key
from shardwise.training.fault.membership import Generation, publish
from shardwise.training.launch.stores import LOOPBACK, host_store


def supervise(
    count: int,
    target: Callable[..., None],
    args: tuple[Any, ...],
    *,
    timeout_s: float,
    restarts: int,
) -> list[Generation]:
    """Run `target(slot, incarnation, endpoint, *args)` (`endpoint`: this store's HOST:PORT)
    for slots 0..count-1 in spawned processes until each ends with exit code 0; a replica that
    dies is dropped from the next generation and replaced (at most `restarts` times in all), its
    replacement admitted once it has said it is ready. The generations published, in order."""
    store = host_store(
        LOOPBACK, 0, world_size=None, timeout=timedelta(seconds=timeout_s), multi_tenant=False
    )
    context = multiprocessing.get_context("spawn")
    endpoint = f"{LOOPBACK}:{store.port}"

    def start(slot: int, incarnation: int) -> Any:
        process = context.Process(target=target, args=(slot, incarnation, endpoint, *args))
        process.start()
        return process

    running = {slot: start(slot, 0) for slot in range(count)}
    incarnations = dict.fromkeys(running, 0)
    members = set(running)
    generations = [publish(store, 0, members)]
    try:
        while running:
            wait([p.sentinel for p in running.values()], timeout=0.02)
            for slot, process in list(running.items()):
                if process.exitcode is None:
                    continue
                del running[slot]
                if process.exitcode == 0:
                    continue
                if sum(incarnations.values()) >= restarts:
                    raise RuntimeError(f"replica {slot} exited {process.exitcode}, no restart left")
                members.discard(slot)
                generations.append(publish(store, len(generations), members))
                incarnations[slot] += 1
                running[slot] = start(slot, incarnations[slot])
            for slot in set(running) - members:  # replacements not yet admitted
                key = join_key(slot)
                if store.check([key]) and int(store.get(key)) == incarnations[slot]:
                    members.add(slot)
                    generations.append(publish(store, len(generations), members, (slot,)))
    finally:
        for process in running.values():
            process.kill()
            process.join()
    return generations
