"""A replica's state sent to another over their process group, tensor by tensor, with no pickle:
how a replacement replica heals from a live peer's memory in live recovery (`fault.mode =
"live"`: fault/live_replica.py).

The sender first sends a description as JSON (each tensor's name, dtype and shape, and any
JSON-able state beside them: counters, the data position, the optimizer's hyperparameters).
The receiver, which built the same model and optimizer from the job, answers whether its own
tensors match that description: a mismatch is one error on both sides before any tensor moves.
Then each tensor goes straight into the receiver's own (`recv` into it), so the receiver ends
bitwise equal to the sender. Checkpoints are data (checkpoint/safe.py); so is a heal.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

from shardwise.training.fault.membership import Collectives

_MATCH, _MISMATCH = 1, 0


class HealError(RuntimeError):
    """The receiver's state is not the sender's shape: they were not built from the same job."""


def send_state(
    pg: Collectives, to_rank: int, tensors: dict[str, torch.Tensor], extra: dict[str, Any]
) -> int:
    """Send `tensors` and the JSON-able `extra` to `to_rank` (which calls `receive_state`);
    the bytes of tensors sent."""
    described = {"tensors": _described(tensors), "extra": extra}
    encoded = torch.frombuffer(bytearray(json.dumps(described).encode()), dtype=torch.uint8)
    pg.send([torch.tensor([encoded.numel()], dtype=torch.int64)], to_rank, 0).wait()
    pg.send([encoded], to_rank, 1).wait()
    answer = torch.zeros(1, dtype=torch.int64)
    pg.recv([answer], to_rank, 2).wait()
    if int(answer.item()) != _MATCH:
        raise HealError(f"rank {to_rank}'s state does not match this one's: it was not built from "
                        "the same job")  # fmt: skip
    sent = 0
    for tag, t in enumerate(tensors.values(), start=3):
        if t.numel() == 0:  # an FSDP shard can be empty: nothing to send (nor to receive)
            continue
        pg.send([t.detach().contiguous()], to_rank, tag).wait()
        sent += t.numel() * t.element_size()
    return sent


Allocate = Callable[[str, torch.dtype, list[int]], "torch.Tensor | None"]
"""Makes the receiver's tensor `name` where it has none yet (an optimizer's state, which exists
only once a step was taken), or returns None: it should have had one."""


def receive_state(
    pg: Collectives,
    from_rank: int,
    into: dict[str, torch.Tensor],
    allocate: Allocate | None = None,
) -> dict[str, Any]:
    """Receive `from_rank`'s state (`send_state`) into the tensors `into`, in place (and into
    those `allocate` makes for names the sender has and `into` lacks); its JSON-able state
    beside them."""
    size = torch.zeros(1, dtype=torch.int64)
    pg.recv([size], from_rank, 0).wait()
    encoded = torch.empty(int(size.item()), dtype=torch.uint8)
    pg.recv([encoded], from_rank, 1).wait()
    described = json.loads(bytes(encoded.numpy()).decode())
    if allocate is not None:
        into = _with_allocated(into, described["tensors"], allocate)
    mine = _described(into)
    match = described["tensors"] == mine
    pg.send([torch.tensor([_MATCH if match else _MISMATCH])], from_rank, 2).wait()
    if not match:
        theirs = {str(n): (d, s) for n, d, s in described["tensors"]}
        ours: dict[str, tuple[object, object]] = {str(n): (d, s) for n, d, s in mine}
        different = sorted(set(theirs) ^ set(ours)) or [n for n in ours if ours[n] != theirs[n]]
        raise HealError(f"rank {from_rank}'s state does not match this one's (first: "
                        f"{different[0]!r}): it was not built from the same job")  # fmt: skip
    for tag, target in enumerate(into.values(), start=3):
        if target.numel() == 0:
            continue
        if target.is_contiguous():
            pg.recv([target.data], from_rank, tag).wait()
        else:
            staged = torch.empty_like(target, memory_format=torch.contiguous_format)
            pg.recv([staged], from_rank, tag).wait()
            target.data.copy_(staged)
    return dict(described["extra"])


def _with_allocated(
    into: dict[str, torch.Tensor], described: list[list[Any]], allocate: Allocate
) -> dict[str, torch.Tensor]:
    """`into` in the sender's order, with what `allocate` makes for the names it lacks (what
    stays missing, or is extra, shows as a mismatch)."""
    ordered: dict[str, torch.Tensor] = {}
    for name, dtype, shape in described:
        found = into.get(name)
        if found is None:
            found = allocate(name, getattr(torch, dtype), shape)
        if found is not None:
            ordered[name] = found
    ordered.update({name: t for name, t in into.items() if name not in ordered})
    return ordered


def _described(tensors: dict[str, torch.Tensor]) -> list[list[Any]]:
    """Each tensor's name, dtype and shape, as JSON carries them (both sides compare these)."""
    return [
        [name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in tensors.items()
    ]


def state_of(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A replica's model and optimizer as named tensors (its parameters, buffers and optimizer
    state, the tensors themselves, so that receiving into them changes the replica) and the
    optimizer's hyperparameters as JSON. The optimizer's state must exist (a step taken, or
    made eagerly)."""
    tensors = {f"model/{name}": t for name, t in model.state_dict(keep_vars=True).items()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, param in enumerate(params):  # in the groups' order: the same on every replica
        state = optimizer.state.get(param, {})
        for key in sorted(state):
            if isinstance(state[key], torch.Tensor):
                tensors[f"optimizer/{index}/{key}"] = state[key]
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return tensors, {"param_groups": groups}


def load_param_groups(optimizer: torch.optim.Optimizer, extra: dict[str, Any]) -> None:
    """The optimizer's hyperparameters from `state_of`'s JSON (a scheduler may have moved lr)."""
    for group, received in zip(optimizer.param_groups, extra["param_groups"], strict=True):
        for key, value in received.items():
            group[key] = tuple(value) if isinstance(group.get(key), tuple) else value
