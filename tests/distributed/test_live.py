"""Live recovery end to end on a toy trainer (fault/live.py, launch/live_supervisor.py): three
replicas on gloo, each a process that `supervise` started; one is SIGKILLed between steps. The
two left go on in the next generation without restarting (same PIDs, every step once); the
supervisor starts a replacement, which says it is ready, is admitted in the generation after,
and heals from the lowest member before its first step; all three then end with the same
parameters and optimizer state, bitwise."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from shardwise.training.fault.heal import load_param_groups, state_of
from shardwise.training.fault.live import LiveGroup, saving_key
from shardwise.training.fault.membership import published
from shardwise.training.launch.live_processes import ReplicaFailed
from shardwise.training.launch.live_supervisor import supervise

pytestmark = pytest.mark.slow
STEPS, KILLED_AFTER, VICTIM, WAIT_AT = 30, 5, 1, 15
TIMEOUT_S = 60.0


def _batch(step: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step * 10 + slot)
    x = torch.randn(8, 4, generator=generator)
    return x, x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(8, 1, generator=generator)


def _trainer(slot: int, local: int, incarnation: int, endpoint: str, out: str) -> None:
    torch.manual_seed(1234 if incarnation else 0)  # a replacement starts elsewhere: it heals
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    live = LiveGroup(endpoint, slot, incarnation, TIMEOUT_S)
    step = 0

    def state() -> tuple[dict[str, torch.Tensor], dict]:
        tensors, extra = state_of(model, optimizer)
        return tensors, {**extra, "step": step}

    if incarnation:  # its optimizer's state must exist to be received into
        x, y = _batch(-1, slot)
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        extra = live.join(state)
        load_param_groups(optimizer, extra)
        step = extra["step"]
    log = open(Path(out) / f"slot{slot}-{incarnation}.jsonl", "w", buffering=1)  # noqa: SIM115
    while step < STEPS:
        if slot == VICTIM and incarnation == 0 and step > KILLED_AFTER:
            time.sleep(3600)  # the test kills it here
        if step == WAIT_AT and live.size < 3:  # a long run: the replacement arrives meanwhile
            while published(live.store) < 2:
                time.sleep(0.02)
        optimizer.zero_grad()
        x, y = _batch(step, slot)
        nn.functional.mse_loss(model(x), y).backward()
        grads = [p.grad for p in model.parameters()]
        summed = torch.cat([g.flatten() for g in grads] + [torch.ones(1)])  # and the members
        if not live.allreduce(summed):
            live.recover(state)
            continue  # the same step, in the next generation
        members, offset = summed[-1], 0
        for g in grads:
            g.copy_(summed[offset : offset + g.numel()].view_as(g) / members)
            offset += g.numel()
        optimizer.step()
        step += 1
        live.committed = step  # a generation's members heal to the highest step committed
        log.write(json.dumps({"step": step, "pid": os.getpid(), "members": members.item()}) + "\n")
        live.boundary(state)
    final = {k: v.detach().clone() for k, v in state_of(model, optimizer)[0].items()}
    torch.save(final, Path(out) / f"final{slot}.pt")


def _steps(out: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (out / name).read_text().splitlines()]


def test_survivors_go_on_and_a_replacement_heals_from_a_peer(tmp_path):
    import threading

    generations: list = []
    runner = threading.Thread(
        target=lambda: generations.extend(
            supervise(3, _trainer, (str(tmp_path),), timeout_s=TIMEOUT_S, restarts=1)
        )
    )
    runner.start()
    victim = tmp_path / f"slot{VICTIM}-0.jsonl"
    deadline = time.monotonic() + TIMEOUT_S
    while not (victim.exists() and len(victim.read_text().splitlines()) > KILLED_AFTER):
        assert time.monotonic() < deadline, "the replicas did not reach the kill point"
        time.sleep(0.05)
    pid = _steps(tmp_path, victim.name)[-1]["pid"]
    os.kill(pid, 9)
    runner.join(TIMEOUT_S * 2)
    assert not runner.is_alive()
    assert [(g.slots, g.joined) for g in generations] == [
        ((0, 1, 2), ()),
        ((0, 2), ()),
        ((0, 1, 2), (1,)),
    ]
    for slot in (0, 2):
        steps = _steps(tmp_path, f"slot{slot}-0.jsonl")
        assert [s["step"] for s in steps] == list(range(1, STEPS + 1))  # every step, once
        assert len({s["pid"] for s in steps}) == 1  # never restarted
        assert {s["members"] for s in steps} == {2.0, 3.0}
    replacement = _steps(tmp_path, f"slot{VICTIM}-1.jsonl")
    assert replacement[0]["step"] > WAIT_AT and replacement[-1]["step"] == STEPS
    finals = [torch.load(tmp_path / f"final{slot}.pt", weights_only=True) for slot in range(3)]
    for name, value in finals[0].items():
        assert torch.equal(value, finals[1][name]) and torch.equal(value, finals[2][name]), name


def _refusing(slot: int, local: int, incarnation: int, endpoint: str) -> None:
    live = LiveGroup(endpoint, slot, incarnation, TIMEOUT_S)
    if slot == 1:
        live.failed("the job is wrong: fix it", config=True)
        raise SystemExit(1)
    time.sleep(3600)  # the supervisor ends it


def test_a_replica_that_finds_the_job_wrong_ends_the_job_with_its_one_line():
    with pytest.raises(ReplicaFailed, match="the job is wrong: fix it") as failed:
        supervise(2, _refusing, (), timeout_s=TIMEOUT_S, restarts=3)
    assert failed.value.config and failed.value.slot == 1


def _saving_when_the_others_die(
    slot: int, local: int, incarnation: int, endpoint: str, out: str
) -> None:
    live = LiveGroup(endpoint, slot, incarnation, TIMEOUT_S)
    if slot == 0:  # the reporting replica, writing a checkpoint that takes a second
        with live.saving():
            time.sleep(1.0)
            (Path(out) / "written").write_text("the whole checkpoint")
        time.sleep(3600)  # the supervisor ends it
    key = saving_key(0, 0)
    while not (live.store.check([key]) and live.store.get(key) == b"1"):
        time.sleep(0.01)  # until replica 0 is writing
    raise SystemExit(1)  # dies: with no restart, fewer than min_replicas are left


def test_a_job_that_ends_lets_a_checkpoint_being_written_finish(tmp_path):
    """The job fails (two of three replicas die, no restart) while replica 0 writes a
    checkpoint: the supervisor waits for the write before it kills replica 0."""
    with pytest.raises(ReplicaFailed, match=r"fewer than fault\.min_replicas"):
        supervise(
            3, _saving_when_the_others_die, (str(tmp_path),), timeout_s=TIMEOUT_S, restarts=0,
            min_replicas=2,
        )  # fmt: skip
    assert (tmp_path / "written").read_text() == "the whole checkpoint"


def _each_failing_once(slot: int, local: int, incarnation: int, endpoint: str, out: str) -> None:
    live = LiveGroup(endpoint, slot, incarnation, 10.0)
    weight = torch.zeros(2)

    def state() -> tuple[dict[str, torch.Tensor], dict]:
        return {"weight": weight}, {}

    assert live.allreduce(torch.ones(1))
    # as after a collective that failed on every member (one stalled past the timeout and
    # woke): each says it is alive and waits for the next generation
    live.recover(state)
    summed = torch.ones(1)
    assert live.allreduce(summed)
    (Path(out) / f"slot{slot}").write_text(f"{summed.item():g} in generation {live.generation}")
    live.close()


def test_when_every_member_says_its_collective_failed_the_same_members_form_the_next_generation(
    tmp_path,
):
    generations = supervise(3, _each_failing_once, (str(tmp_path),), timeout_s=10.0, restarts=0)
    assert [g.slots for g in generations] == [(0, 1, 2), (0, 1, 2)]
    for slot in range(3):
        assert (tmp_path / f"slot{slot}").read_text().startswith("3 in generation")


def _late_survivor(slot: int, local: int, incarnation: int, endpoint: str, out: str) -> None:
    live = LiveGroup(endpoint, slot, incarnation, TIMEOUT_S)
    weight, step, tried = torch.zeros(2), 0, []
    # each generation it forms after the first (the hook's other points: a heal it sends)
    live.hook = lambda point: tried.append(live.generation.number) if point == "reform" else None

    def state() -> tuple[dict[str, torch.Tensor], dict]:
        return {"weight": weight}, {"step": step}

    if incarnation:
        step = live.join(state)["step"]
    while step < 4:
        if step == 2 and incarnation == 0 and slot == 2:
            os.kill(os.getpid(), 9)
        if step == 2 and slot == 0 and not tried[1:]:
            time.sleep(4)  # comes to the failed collective after the replacement is ready
        if not live.allreduce(torch.ones(1)):
            live.recover(state)
            continue
        step += 1
        live.committed = step
        live.boundary(state)
    (Path(out) / f"slot{slot}-{incarnation}").write_text(json.dumps(tried))
    live.close()


def test_a_replacement_is_admitted_only_once_every_member_formed_the_generation_before(
    tmp_path,
):
    """Replica 2 dies; replica 1 forms the generation without it at once, replica 0 comes to
    it late, after the replacement said it is ready. Had the generation admitting it been
    published then, replica 0 would have formed that one and replica 1 would have waited for
    it in the one before until its formation timed out: every member forms the same ones."""
    supervise(3, _late_survivor, (str(tmp_path),), timeout_s=TIMEOUT_S, restarts=1)
    tried = [json.loads((tmp_path / f"slot{s}-0").read_text()) for s in (0, 1)]
    assert tried[0] == tried[1] == [1, 2]
