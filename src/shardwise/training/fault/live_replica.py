"""A training run's replica in live recovery (`fault.mode = "live"`): what the trainer calls in
place of DDP to sum the replicas' gradients, and at the steps' boundaries to follow the
membership (fault/live.py) and heal replacements.

Each replica is a process of its own, the whole model on it (a world of one for everything
else: checkpoints, evaluation). A step's samples are split over the live replicas, in chunks
that differ by at most one (data/sampling.py), and `reduce` sums the gradients weighted by
each replica's samples, with the loss and the sample count, in one all-reduce: the update is
the one a single process makes on the whole batch.

When a replica dies inside a step, the survivors' all-reduce fails at once; they take the next
generation and do the step again (`StepAgain`) with its membership, from the same state and
the same data position: no sample of the step is lost and none is read twice, and the run is
the one that membership would have made. Where a survivor's all-reduce failed and another's
completed (gloo's ring can end so when a member dies inside it), the one that completed has
committed the step: in the next generation every member below the highest step committed
receives the state of one at it (`StepTaken`), so that no step is done twice or on top of
another. A replacement is admitted at a step boundary, or
inside a step being done again; a member sends it the state as of the last committed step
(parameters, buffers, optimizer state, schedules, scaler, step, data position), tensor by
tensor, and both then compare a hash of what they hold.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardwise.common.console import human_bytes
from shardwise.common.errors import ConfigError, first_line
from shardwise.training.data.sampling import chunk
from shardwise.training.fault.heal import load_param_groups, state_of
from shardwise.training.fault.live import LiveGroup


class StepAgain(Exception):
    """The membership changed inside the step: do it again, from its start, with the new one."""


class StepTaken(Exception):
    """This replica's all-reduce failed where its peers' completed (gloo's ring can end so when
    a member dies inside it): they committed the step, and this replica now holds their state
    after it. The step is done; `loss` is the step's, as they reduced it."""

    def __init__(self, step: int, loss: float) -> None:
        super().__init__(f"step {step} taken from the replica's peers")
        self.step, self.loss = step, loss


class StateDiverged(RuntimeError):
    """Replicas that must hold the same state do not (their hashes differ)."""


@dataclass
class Parts:
    """What a replica holds that a replacement must receive."""

    modules: list[nn.Module]
    optimizers: list[torch.optim.Optimizer]
    schedulers: list[Any]
    scaler: Any
    loader: Any
    """The run's `StepLoader`: its position, and where in each step it reads (`place`)."""
    parameters: Callable[[], list[nn.Parameter]]
    traffic: Any = None
    """The run's `comm.base.Traffic`, which counts the bytes the all-reduce sends."""
    position: tuple[int, int] = (0, 1)
    """This process's data-parallel rank and their number inside its replica (its FSDP rank:
    tensor-parallel peers read the same samples)."""
    stages: int = 1
    """The replica's pipeline ranks (its processes hold one stage each: the last the loss)."""
    unit: int = 1
    """Under a pipeline, its micro-batch: a replica's share of a step is whole ones (its
    stages run equal ones)."""
    reschedule: Callable[[int], None] | None = None
    """Under a pipeline: run this many micro-batches a step from now on."""
    reseed: Callable[[int, int], None] | None = None
    """Seeds this process's generators (dropout) from (step, rank), as a data-parallel rank's
    are seeded (trainer/state.reseed): each replica its own stream, drawn again from the step a
    membership change takes effect at."""


@dataclass
class LiveReplica:
    group: LiveGroup
    parts: Parts
    min_replicas: int = 2
    """The fewest replicas that commit a step (`fault.min_replicas`)."""
    faults: Any = None
    """The run's `FaultPlan`: kills at points of a step and of a membership change."""
    check_every: int = 0
    """Compare the members' state hashes every this many steps too (0: after heals only)."""
    position: dict[str, Any] = field(default_factory=dict)
    """The data position at the start of the step in progress (what a replacement starts at)."""
    events: list[tuple[int, str, dict[str, float]]] = field(default_factory=list)
    """What happened since the loop last asked (`drain`): a line to say and metrics to record."""
    _loss: torch.Tensor | None = None
    """The last committed step's loss, as reduced (what a member behind is sent with it)."""
    _received_loss: float = float("nan")
    """The loss of the step received last (a member behind reports it as its own)."""
    _lost_at: float | None = None
    _buffers: list[torch.Tensor] = field(default_factory=list)
    """The buffers' values at the start of the step (a step done again starts from them)."""
    _flat: torch.Tensor | None = None
    """What the all-reduce sends: the gradients (each parameter's `.grad` a view of it), the
    floating buffers, the loss, the sample count and the flag (live.py)."""
    _params: list[nn.Parameter] = field(default_factory=list)
    _views: list[torch.Tensor] = field(default_factory=list)
    _floating: list[torch.Tensor] = field(default_factory=list)
    _grad_numel: int = 0
    """Where the gradients end in `_flat` (the floating buffers follow)."""
    _replica_samples: int = 0
    """The samples this replica reads each step (all its processes')."""
    _rank: int | None = None
    """This process's rank among all the replicas' in the current generation, until `begin`
    seeds its generators from it (None: seeded)."""

    @property
    def width(self) -> int:
        """The replica's processes (under HSDP its FSDP ranks; 1: the whole model in one)."""
        return self.group.width

    @property
    def step(self) -> int:
        """The last step this replica committed (its group's heal rule reads it too)."""
        return self.group.committed

    @step.setter
    def step(self, value: int) -> None:
        self.group.committed = value

    def __post_init__(self) -> None:
        self._place()
        if self.faults is not None and self.faults.faults:
            self.group.hook = lambda point: self._kill_at(point)

    def _kill_at(self, point: str) -> None:
        if self.faults is not None:
            self.faults.kill_at(point, self.step + 1)

    # the trainer's calls, in the order of a step

    def begin(self, step: int) -> None:
        """Step `step` starts: its data position is what a replacement admitted inside it
        starts from."""
        self.step = step - 1
        self.position = dict(self.parts.loader.state_dict())
        if self._rank is not None and self.parts.reseed is not None:
            # the first step, or the first in a new generation: as DDP's rank of this number is
            # seeded at the start (step 0), so that a run without failures draws what it draws
            self.parts.reseed(step - 1, self._rank)
            self._rank = None
        self._bind_gradients()
        buffers = self._all_buffers()
        if len(self._buffers) != len(buffers):
            self._buffers = [b.detach().clone() for b in buffers]
        else:
            for saved, b in zip(self._buffers, buffers, strict=True):
                saved.copy_(b)

    def reduce(self, loss: torch.Tensor) -> torch.Tensor:
        """Sum the replicas' gradients, each weighted by its samples, into every replica's
        `.grad` (divided by the step's samples: the whole batch's mean), and their floating
        buffers likewise (a batch norm's running mean becomes the one the whole batch gives);
        the batch's mean loss (`loss`: this replica's mean). `StepAgain` where a replica died
        meanwhile."""
        flat = self._pack(loss)
        self._kill_at("reduce")
        ok = self.group.allreduce_in_place(flat) and not self._lost_reply()
        ok, summed = self.group.settle(ok, (float(flat[-3]),) if self.width > 1 else ())
        if not ok:
            doing = self.step + 1
            self._recover()
            if self.step >= doing:  # the peers committed it: this replica holds their state
                raise StepTaken(doing, self._received_loss)
            raise StepAgain
        if self.parts.traffic is not None:
            nbytes = flat.numel() * flat.element_size()
            self.parts.traffic.all_reduce(nbytes, self.group.size)
            self.parts.traffic.uncompressed += 2 * (self.group.size - 1) / self.group.size * nbytes
        self._kill_at("after_reduce")
        if self.width > 1:  # the siblings' parts of the loss, each summed over the replicas
            flat[-3] = summed[0]
        self._unpack(flat)
        self._stepping_again_after_loss()
        self._loss = flat[-3].clone()
        return self._loss.to(loss.dtype)

    def _pack(self, loss: torch.Tensor) -> torch.Tensor:
        """`_flat` as the all-reduce sends it: the gradients (FSDP's shards copied in), the
        floating buffers, the loss and the count, each weighted by the replica's samples: a
        replica of one process has reduced nothing yet; FSDP's shards hold the replica's mean
        already (`shares`), and the loss is this process's part of it."""
        flat = self._flat
        assert flat is not None, "begin() binds the gradients"
        for p, view in zip(self._params, self._views, strict=True):
            if isinstance(p, DTensor):  # this process's shard of the replica's gradient
                view.copy_(_local(_placed(p.grad, p))) if p.grad is not None else view.zero_()
            elif p.grad is not view:  # replaced by something other than the backward: copied in
                view.copy_(p.grad if p.grad is not None else torch.zeros_like(view))
                p.grad = view
        offset = self._grad_numel
        for b in self._floating:
            flat[offset : offset + b.numel()].copy_(b.detach().flatten())
            offset += b.numel()
        # each process's part of the replica's mean loss: a pipeline's last stage holds it
        # whole, its other stages nothing
        flat[-3], flat[-2] = loss.detach() / (self.width // self.parts.stages), 1.0
        flat[:-1].mul_(self._replica_samples)
        return flat

    def _unpack(self, flat: torch.Tensor) -> None:
        """The summed `flat` divided by the step's samples, into the gradients (FSDP's shards
        copied back) and the floating buffers."""
        flat[:-2].div_(flat[-2].clone())
        for p, view in zip(self._params, self._views, strict=True):
            if isinstance(p, DTensor) and p.grad is not None:  # placed as the parameter
                p.grad = DTensor.from_local(
                    view, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
                )
        offset = self._grad_numel
        for b in self._floating:
            b.copy_(flat[offset : offset + b.numel()].view_as(b))
            offset += b.numel()

    def shares(self, sizes: list[int]) -> list[float] | None:
        """In a replica of several processes, each micro-batch's share of the replica's mean
        (times its FSDP ranks: FSDP averages them), so that they may read a sample more or less
        than each other; None in a replica of one (its shares are of its own samples)."""
        if self.width == 1:
            return None
        return [size * self.parts.position[1] / self._replica_samples for size in sizes]

    def _lost_reply(self) -> bool:
        """Whether fault injection takes this completed all-reduce as failed (`lose`)."""
        return self.faults is not None and self.faults.loses(self.step + 1)

    def _bind_gradients(self) -> None:
        """Every parameter's `.grad` a view of `_flat`, zeroed: the backward passes accumulate
        into what the all-reduce sends, as DDP's `gradient_as_bucket_view` does."""
        if self._flat is None:
            self._params = [p for p in self.parts.parameters() if p.requires_grad]
            self._floating = [b for b in self._all_buffers() if b.is_floating_point()]
            mine = [_local(p) for p in self._params]  # under FSDP, this process's shards
            kinds = {(p.dtype, p.device) for p in mine}
            if len(kinds) != 1:
                raise ConfigError(
                    "fault.mode = 'live' needs the model's parameters in one dtype on one device "
                    f"(found {sorted(str(k) for k in kinds)}); set fault.mode = 'restart'"
                )
            dtype, device = next(iter(kinds))
            sizes = [p.numel() for p in mine]
            self._grad_numel = sum(sizes)
            extra = sum(b.numel() for b in self._floating) + 3  # loss, samples, flag
            self._flat = torch.zeros(sum(sizes) + extra, dtype=dtype, device=device)
            pieces = torch.split(self._flat[: sum(sizes)], sizes)
            self._views = [v.view_as(p) for v, p in zip(pieces, mine, strict=True)]
        else:
            self._flat.zero_()
        for p, view in zip(self._params, self._views, strict=True):
            # FSDP's reduce-scatter makes its own sharded gradient (copied in by `reduce`)
            p.grad = None if isinstance(p, DTensor) else view

    def _all_buffers(self) -> list[torch.Tensor]:
        return [b for module in self.parts.modules for b in module.buffers()]

    def boundary(self, step: int) -> None:
        """Step `step` is committed: where a member saw a newer generation, every member moves
        to it here (healing its replacements)."""
        self.step = step
        self.position = dict(self.parts.loader.state_dict())
        before = self.group.generation
        received = self.group.boundary(self._state, self._allocate)
        if received:
            self._load(received)
        if self.group.generation != before:
            self._moved(step + 1)
        elif self.check_every and step % self.check_every == 0:
            self._compare_hashes()

    def join(self) -> int:
        """A replacement's start: be admitted, receive a member's state; the step it continues
        after."""
        began = time.perf_counter()
        extra = self.group.join(self._state, self._allocate)
        self._load(extra)
        self._place()
        self._compare_hashes()
        generation = self.group.generation
        assert generation is not None
        self.events.append(
            (
                self.step + 1,
                f"replica {self.group.slot} (replacement {self.group.incarnation}) healed from "
                f"replica {self.group.received_from} in "
                f"{time.perf_counter() - began:.2f} s and continues after step {self.step} with "
                f"{len(generation.slots)} replicas",
                {"live/heal_received_s": time.perf_counter() - began},
            )
        )
        return self.step

    @property
    def reports(self) -> bool:
        """Whether this process reports the run (membership.Generation.reporter; under HSDP
        the replica's first process)."""
        return self.saves and self.group.local == 0

    @property
    def saves(self) -> bool:
        """Whether this replica writes the run's checkpoints (and evaluates): the one that
        reports, so that the summary it writes names the newest; under HSDP all its
        processes, each its shards."""
        generation = self.group.generation
        return generation is not None and generation.reporter == self.group.slot

    def drain(self) -> list[tuple[int, str, dict[str, float]]]:
        """What happened since the last drain: each at the first step the membership it
        describes does (a change at a step boundary: the next step), a line to say (or "")
        and metrics to record."""
        events, self.events = self.events, []
        return events

    # membership

    def _recover(self) -> None:
        """A collective failed: the next generation, in which the members behind the highest
        step committed are healed (the replacements; this replica, where its collective failed
        and its peers' completed); the step is done again in it, or taken from the peers."""
        self._lost_at = time.perf_counter()
        for saved, b in zip(self._buffers, self._all_buffers(), strict=True):
            b.copy_(saved)  # as the step found them (a replacement receives them so, too)
        before, committed = self.group.generation, self.step
        received = self.group.recover(self._state, self._allocate)
        after = self.group.generation
        assert before is not None
        assert after is not None
        # a replacement already admitted (new in `after`) is not a survivor
        lost = sorted(set(before.slots) - (set(after.slots) - set(after.joined)))
        left = len(after.slots) - len(after.joined)
        said = f"{left} left do the step again"
        if received:  # the others committed the step: this replica now holds it
            said = (
                f"{left} left; replica {self.group.slot}'s all-reduce failed where its peers' "
                f"completed, and it takes the step they committed from replica "
                f"{self.group.received_from}"
            )
        self.events.append(
            (
                committed + 1,
                f"step {committed + 1}: lost replica{'s' if len(lost) > 1 else ''} "
                f"{', '.join(map(str, lost))}; {said} (generation {after.number})",
                {
                    "live/replicas": float(left),
                    "live/lost_replicas": float(len(lost)),
                    "live/detected_s": time.perf_counter() - self._lost_at,
                },
            )
        )
        if received:
            self._behind(committed, received)
        self._moved(self.step + 1)
        while self.group.size < self.min_replicas:
            self._wait_for_more()
        self.parts.loader.load_state_dict(self.position)  # the step's samples, read again

    def _behind(self, committed: int, received: dict[str, Any]) -> None:
        """This replica received its peers' state after steps it had not committed."""
        self._load(received)
        self.events.append((committed + 1, "", {"live/behind_steps": float(self.step - committed)}))

    def _wait_for_more(self) -> None:
        """Fewer replicas than `min_replicas`: nothing commits until a replacement joins."""
        left, began = self.group.size, time.perf_counter()
        self.events.append(
            (
                self.step + 1,
                f"step {self.step + 1}: {left} replica{'s' if left > 1 else ''} left, fewer "
                f"than fault.min_replicas ({self.min_replicas}): nothing commits until a "
                "replacement joins",
                {},
            )
        )
        committed = self.step
        try:
            received = self.group.wait_for_more(self._state, self._allocate)
        except (TimeoutError, RuntimeError) as e:
            raise RuntimeError(
                f"{left} replica{'s' if left > 1 else ''} left, fewer than fault.min_replicas "
                f"({self.min_replicas}), and no replacement joined within fault.timeout_s "
                f"({self.group.timeout_s:g} s): {first_line(e)}"
            ) from None
        self.events.append((self.step + 1, "", {"live/waited_s": time.perf_counter() - began}))
        if received:
            self._behind(committed, received)
        self._moved(self.step + 1)

    def _stepping_again_after_loss(self) -> None:
        if self._lost_at is not None:
            stalled = time.perf_counter() - self._lost_at
            self.events.append((self.step + 1, "", {"live/stall_s": stalled}))
            self._lost_at = None

    def _moved(self, step: int) -> None:
        """A new generation: read this replica's share of each step from now on; where a heal
        was sent, say so and check it."""
        self._place()
        heal = self.group.healed
        if heal is not None:
            self.group.healed = None
            sent, seconds = float(heal.bytes), heal.seconds
            siblings = self.group.siblings
            if siblings is not None:  # each of the replica's processes sent its shards
                sent = siblings.sum([sent])[0]
                seconds = siblings.max(seconds)  # the slowest's
            self.events.append(
                (
                    step,
                    f"step {step}: replica {self.group.slot} healed replica"
                    f"{'s' if len(heal.to) > 1 else ''} {', '.join(map(str, heal.to))} "
                    f"({human_bytes(int(sent))} in {seconds:.2f} s)",
                    {
                        "live/heal_bytes": sent,
                        "live/heal_s": seconds,
                        "live/heal_source": float(heal.source),
                        "live/healed_replicas": float(len(heal.to)),
                        "live/replicas": float(self.group.size),
                    },
                )
            )
        if self.group.behind:
            self._compare_hashes()

    def _place(self) -> None:
        """This process's share of each step in the current generation: a replica's chunk of
        the batch, split over its data-parallel ranks (contiguous: `sampling.chunk` of them
        all; tensor-parallel peers read the same). Under a pipeline, whole micro-batches, as
        many for each of the replica's FSDP ranks (their collectives run per micro-batch): the
        replica's chunk in units of that many, then split equally."""
        if self.group.generation is None:
            return
        rank, width = self.parts.position
        first = self.group.rank * width
        self._rank = first + rank
        batch = self.parts.loader.sampler.global_batch
        if self.parts.reschedule is None:
            total = self.group.size * width
            self.parts.loader.place(first + rank, total)
            self._replica_samples = (
                chunk(batch, first + width, total)[0] - chunk(batch, first, total)[0]
            )
            return
        start, end = chunk(batch, self.group.rank, self.group.size, self.parts.unit * width)
        self._replica_samples = end - start
        mine = self._replica_samples // width  # whole micro-batches, as many for each rank
        self.parts.loader.place_span(start + rank * mine, start + (rank + 1) * mine)
        self.parts.reschedule(mine // self.parts.unit)

    # the state a replacement receives

    def _state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors: dict[str, torch.Tensor] = {}
        groups = []
        for index, (module, optimizer) in enumerate(
            zip(self.parts.modules, self.parts.optimizers, strict=True)
        ):
            mine, extra = state_of(module, optimizer)
            tensors.update({f"{index}/{name}": _local(t) for name, t in mine.items()})
            groups.append(extra)
        extra = {
            "step": self.step,
            "loss": None if self._loss is None else float(self._loss),
            "position": self.position,
            "optimizers": groups,
            "schedulers": [s.state_dict() for s in self.parts.schedulers],
            "scaler": self.parts.scaler.state_dict(),
        }
        return tensors, extra

    def _allocate(self, name: str, dtype: torch.dtype, shape: list[int]) -> torch.Tensor | None:
        """An optimizer's state tensor the sender has and this replica, which has taken no
        step, lacks: made where the optimizer would make it."""
        index, kind, *rest = name.split("/")
        if kind != "optimizer":
            return None
        optimizer = self.parts.optimizers[int(index)]
        number, key = int(rest[0]), rest[1]
        params = [p for g in optimizer.param_groups for p in g["params"]]
        param = params[number]
        group = next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))
        on_device = key != "step" or group.get("fused") or group.get("capturable")
        made = torch.zeros(shape, dtype=dtype, device=param.device if on_device else "cpu")
        if isinstance(param, DTensor) and key != "step":  # FSDP's: a shard, as the parameter
            optimizer.state[param][key] = DTensor.from_local(
                made, param.device_mesh, param.placements, shape=param.shape,
                stride=param.stride(),
            )  # fmt: skip
        else:
            optimizer.state[param][key] = made
        return made

    def _load(self, extra: dict[str, Any]) -> None:
        for optimizer, groups in zip(self.parts.optimizers, extra["optimizers"], strict=True):
            load_param_groups(optimizer, groups)
        for scheduler, state in zip(self.parts.schedulers, extra["schedulers"], strict=True):
            scheduler.load_state_dict(state)
        if extra["scaler"]:
            self.parts.scaler.load_state_dict(extra["scaler"])
        self.step = int(extra["step"])
        self._received_loss = float("nan") if extra["loss"] is None else float(extra["loss"])
        self.position = dict(extra["position"])
        self.parts.loader.load_state_dict(self.position)

    def _compare_hashes(self) -> None:
        """Every member's hash of its state (after a heal, and every `check_every` steps)
        against the others': the same, or `StateDiverged`."""
        digest = torch.tensor(list(state_hash(self._state()[0])), dtype=torch.float64)
        mine = torch.cat([digest, digest.square()])
        summed = mine.clone()
        ok, _ = self.group.settle(self.group.allreduce(summed))
        if not ok:
            self._recover()
            return
        # every member's digest equal: the sums of the bytes and of their squares say so
        if not torch.equal(summed, mine * self.group.size):
            raise StateDiverged(
                f"the replicas' states differ after step {self.step} (replica "
                f"{self.group.slot}'s hash against its peers'): a silent corruption, in memory "
                "or in a heal; the checkpoints saved before it are intact"
            )


def state_hash(tensors: dict[str, torch.Tensor]) -> bytes:
    """A digest of the tensors' names and bytes, in order."""
    digest = hashlib.blake2b(digest_size=16)
    for name, t in tensors.items():
        digest.update(name.encode())
        digest.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.digest()


def _placed(grad: torch.Tensor, param: DTensor) -> torch.Tensor:
    """`grad` placed as `param` is (tensor parallelism's embedding leaves its gradient
    replicated where the weight is sharded: the shard is then a slice of it, no traffic)."""
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        return grad.redistribute(param.device_mesh, param.placements)
    return grad


def _local(t: torch.Tensor) -> torch.Tensor:
    """This process's part of `t`: its local shard where FSDP sharded it (the storage itself:
    receiving into it changes the parameter)."""
    if isinstance(t, DTensor):
        with torch.no_grad():
            return t.to_local()
    return t
