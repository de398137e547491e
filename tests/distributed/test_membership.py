"""Live membership (fault/membership.py) with real processes on gloo: three replicas all-reduce
in generation 0; one is SIGKILLed between steps; the two left, the same processes, find their
collective failed, take the coordinator's generation 1 and redo that step in it, with no step
lost or repeated. A replica whose slot a newer generation dropped is fenced."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from shardwise.training.fault.membership import Fenced, current, group, newer, publish
from shardwise.training.launch.stores import LOOPBACK, host_store

pytestmark = pytest.mark.slow
STEPS, KILLED_AFTER, VICTIM = 12, 5, 1
TIMEOUT_S = 60.0


def _replica(slot: int, port: int, out: str) -> None:
    """All-reduce `slot + 1` once a step; on a failed collective, go on in the next generation
    and redo the step. The victim stops after its step KILLED_AFTER and waits to be killed."""
    store = TCPStore(LOOPBACK, port, is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
    generation = current(store, TIMEOUT_S)
    pg = group(store, generation, slot, TIMEOUT_S)
    step = 0
    with open(Path(out) / f"slot{slot}.jsonl", "w", buffering=1) as log:
        while step < STEPS:
            if slot == VICTIM and step > KILLED_AFTER:
                time.sleep(3600)  # the test kills it here, between two steps
            value = torch.tensor([float(slot + 1)])
            try:
                pg.allreduce([value]).wait()
            except RuntimeError:
                failed = time.time()
                generation = newer(store, generation.number, TIMEOUT_S)
                pg = group(store, generation, slot, TIMEOUT_S)
                log.write(json.dumps({"failed": failed, "generation": generation.number}) + "\n")
                continue  # the same step again, in the new generation
            log.write(json.dumps({"step": step, "generation": generation.number,
                                  "sum": value.item(), "pid": os.getpid()}) + "\n")  # fmt: skip
            step += 1


def _records(out: Path, slot: int) -> list[dict]:
    path = out / f"slot{slot}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def test_survivors_go_on_in_the_next_generation_without_losing_a_step(tmp_path):
    store = host_store(
        LOOPBACK, 0, world_size=None, timeout=timedelta(seconds=TIMEOUT_S), multi_tenant=False
    )
    context = multiprocessing.get_context("spawn")
    replicas = {
        slot: context.Process(target=_replica, args=(slot, store.port, str(tmp_path)))
        for slot in range(3)
    }
    for process in replicas.values():
        process.start()
    publish(store, 0, [0, 1, 2])
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while len([r for r in _records(tmp_path, VICTIM) if "step" in r]) <= KILLED_AFTER:
            assert time.monotonic() < deadline, "the replicas did not reach the kill point"
            time.sleep(0.05)
        killed = time.time()
        os.kill(replicas[VICTIM].pid, signal.SIGKILL)
        replicas[VICTIM].join(TIMEOUT_S)
        publish(store, 1, [0, 2])  # the coordinator saw it exit
        for slot in (0, 2):
            replicas[slot].join(TIMEOUT_S)
            assert replicas[slot].exitcode == 0, f"slot {slot} exited {replicas[slot].exitcode}"
    finally:
        for process in replicas.values():
            if process.is_alive():
                process.kill()
                process.join()
    for slot in (0, 2):
        records = _records(tmp_path, slot)
        steps = [r for r in records if "step" in r]
        assert [r["step"] for r in steps] == list(range(STEPS))  # none lost, none twice
        assert {r["pid"] for r in steps} == {replicas[slot].pid}  # the same process throughout
        assert [r["sum"] for r in steps] == [6.0] * (KILLED_AFTER + 1) + [4.0] * (
            STEPS - KILLED_AFTER - 1
        )
        assert [r["generation"] for r in records if "failed" in r] == [1]
        detected = next(r["failed"] for r in records if "failed" in r) - killed
        print(f"slot {slot}: its collective failed {detected * 1000:.0f} ms after the kill")


def test_a_replica_left_out_of_the_newest_generation_is_fenced():
    store = host_store(
        LOOPBACK, 0, world_size=None, timeout=timedelta(seconds=10), multi_tenant=False
    )
    publish(store, 0, [0, 1, 2])
    generation = publish(store, 1, [2, 0])
    assert generation.slots == (0, 2) and generation.rank_of(2) == 1
    assert current(store, 10) == generation
    with pytest.raises(Fenced, match="slot 1 is not in generation 1"):
        group(store, current(store, 10), 1, 10)
