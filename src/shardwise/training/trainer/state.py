"""What a checkpoint holds, and how a run is put back exactly as it was.

A checkpoint is one DCP state dict:
- `model`, `optim`: from torch's `get_model_state_dict` / `get_optimizer_state_dict` (optimizer
  state flattened to `state.<param>.<name>` keys), merged over the run's model parts, keyed by
  the user's module names whatever the wrapper, sharding or pipeline split, so they load under
  any layout (DCP reshards on load);
- `train`: step, data position, LR scheduler, gradient scaler (small, written once by rank 0);
- `rng`: each rank's random-number generator states, as tensors, under its own key `rank<N>`.

Everything is tensors or plain numbers, lists and dicts: a checkpoint is data, and it is loaded
as data (checkpoint/safe.py).

Resuming on the same layout restores every generator, so the continued run is bitwise the run
that never stopped. On another layout the old ranks' generators mean nothing; each rank then
reseeds from (seed, step, data-parallel rank), which is deterministic but a different stream.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from shardwise.training.comm.base import Sync
from shardwise.training.data.sampling import Loader

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
IMPLEMENTATION = ("fused", "foreach")
"""Optimizer settings that say how to compute, not what: a checkpoint's are not restored (a
layout whose parameters mix plain tensors and DTensors cannot use the fused kernel)."""


def capture(
    *,
    parts: list[nn.Module],
    optimizers: list[torch.optim.Optimizer],
    scheduler: Any,
    scaler: Any,
    loader: Loader,
    step: int,
    rank: int,
    sync: Sync,
) -> dict[str, Any]:
    model_state: dict[str, Any] = {}
    optim_state: dict[str, Any] = {}
    for part, optimizer in zip(parts, optimizers, strict=True):
        model_state.update(_whole(get_model_state_dict(part)))
        optim_state.update(_whole(get_optimizer_state_dict(part, optimizer, options=_FLAT)))
    # after the optimizer states exist (torch creates them above): the sync's refer to them
    sync_state = sync.state_dict(rank)
    return {
        "model": sync.consensus(model_state),
        "optim": optim_state,
        "train": {
            "step": step,
            "data": loader.state_dict(),
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict() if scaler.is_enabled() else {},
        },
        "rng": {f"rank{rank}": rng_tensors()},
        **({"sync": sync_state} if sync_state else {}),
    }


def own_buffers(state: dict[str, Any], parts: list[nn.Module]) -> frozenset[str]:
    """The flattened keys of `state`'s buffers (a BatchNorm's running statistics): each
    data-parallel rank updates its own, so the checkpoint stores the first replica's
    (checkpoint/planner.py). Found by storage, whatever names a wrapper gives them."""
    held = {b.data_ptr() for part in parts for b in part.buffers() if not isinstance(b, DTensor)}
    return frozenset(
        f"model.{key}"
        for key, value in state["model"].items()
        if isinstance(value, torch.Tensor)
        and not isinstance(value, DTensor)
        and value.data_ptr() in held
    )


def apply(
    state: dict[str, Any],
    *,
    parts: list[nn.Module],
    optimizers: list[torch.optim.Optimizer],
    schedulers: list[Any],
    scaler: Any,
    loader: Loader,
    sync: Sync,
    rank: int,
) -> int:
    """Put a loaded state dict back into the run's objects; returns the step it was taken at."""
    for part, optimizer in zip(parts, optimizers, strict=True):
        live = get_model_state_dict(part)
        set_model_state_dict(part, {k: _like(state["model"][k], v) for k, v in live.items()})
        live_optim: dict[str, Any] = get_optimizer_state_dict(part, optimizer, options=_FLAT)
        optim = {k: _like(v, live_optim.get(k)) for k, v in state["optim"].items()}
        set_optimizer_state_dict(part, optimizer, optim, options=_FLAT)
        for group in optimizer.param_groups:  # this layout's implementation, not the saver's
            group.update({k: optimizer.defaults[k] for k in IMPLEMENTATION if k in group})
    train = state["train"]
    for scheduler in schedulers:
        scheduler.load_state_dict(train["scheduler"])
    if scaler.is_enabled() and train["scaler"]:
        scaler.load_state_dict(train["scaler"])
    loader.load_state_dict(train["data"])
    if "rng" in state:
        (states,) = state["rng"].values()
        _set_rng_tensors(states)
    if "sync" in state:
        sync.load_state_dict(state["sync"], rank)
    return int(train["step"])


def _whole(state: dict[str, Any]) -> dict[str, Any]:
    """The state with every tensor DCP cannot store as one block per rank gathered whole: a
    strided shard that is not split again (GPT-2's fused query/key/value under tensor
    parallelism holds a slice of each of its three parts). Every rank of its mesh gathers it;
    DCP then writes it once, as it does any replicated tensor."""
    return {k: v.full_tensor() if _scattered(v) else v for k, v in state.items()}


def _scattered(value: Any) -> bool:
    if not isinstance(value, DTensor):
        return False
    placements = list(value.placements)
    return any(
        isinstance(p, _StridedShard)
        and not any(type(q) is Shard and q.dim == p.dim for q in placements[i + 1 :])
        for i, p in enumerate(placements)
    )


def _like(loaded: Any, live: Any) -> Any:
    """A tensor loaded whole, split again as this run holds it."""
    whole = isinstance(loaded, torch.Tensor) and not isinstance(loaded, DTensor)
    if isinstance(live, DTensor) and whole:
        return distribute_tensor(loaded, live.device_mesh, live.placements, src_data_rank=None)
    return loaded


def with_saved_rng(state: dict[str, Any], saved: set[str]) -> tuple[dict[str, Any], bool]:
    """The state to request from a checkpoint that holds the names `saved`, and whether it
    brings this rank's random-number states back: only those it holds as tensors (an older
    shardwise pickled them, and a pickle is not loaded: it could run code)."""
    ((rank, mine),) = state["rng"].items()
    present = {k: v for k, v in mine.items() if f"rng.{rank}.{k}" in saved}
    if "torch" not in present:
        return without_rng(state), False
    return {**state, "rng": {rank: present}}, True


def without_rng(state: dict[str, Any]) -> dict[str, Any]:
    """The state to request when the checkpoint came from another layout: neither random
    states nor the sync's (each rank's own)."""
    return {k: v for k, v in state.items() if k not in ("rng", "sync")}


def with_saved_sync(state: dict[str, Any], saved: set[str]) -> tuple[dict[str, Any], bool]:
    """The state to request of the sync's (compression residuals, DiLoCo's outer state, local
    SGD's per-rank parameters): only what the checkpoint holds (a run may switch modes), and
    whether it holds all of it."""
    if "sync" not in state:
        return state, True
    kept: dict[str, Any] = {}
    complete = True
    for section, values in state["sync"].items():
        present = {k: v for k, v in values.items() if f"sync.{section}.{k}" in saved}
        complete &= len(present) == len(values)
        if present:
            kept[section] = present
    rest = {k: v for k, v in state.items() if k != "sync"}
    return ({**rest, "sync": kept} if kept else rest), complete


def reseed(seed: int, step: int, rank: int) -> None:
    """Seed every generator of this rank from (seed, step, rank)."""
    value = (seed * 1_000_003 + step) * 1_009 + rank
    torch.manual_seed(value)
    random.seed(value)
    np.random.seed(value % 2**32)


def rng_tensors() -> dict[str, torch.Tensor]:
    """This process's random-number states as tensors (a checkpoint holds data, not pickles):
    torch's (and CUDA's) as the bytes torch gives, Python's and NumPy's Mersenne Twisters as
    their words and position."""
    version, words, gauss = random.getstate()
    _, keys, position, has_gauss, cached = np.random.get_state(legacy=True)
    assert isinstance(keys, np.ndarray)
    states = {
        "torch": torch.get_rng_state(),
        "python": torch.tensor([version, *words], dtype=torch.int64),
        "python_gauss": torch.tensor([gauss is not None, gauss or 0.0], dtype=torch.float64),
        "numpy": torch.from_numpy(keys.astype(np.int64)),
        "numpy_rest": torch.tensor([position, has_gauss, cached], dtype=torch.float64),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _set_rng_tensors(states: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(states["torch"])
    version, *words = (int(w) for w in states["python"].tolist())
    has_gauss, gauss = states["python_gauss"].tolist()
    random.setstate((version, tuple(words), gauss if has_gauss else None))
    position, has_cached, cached = states["numpy_rest"].tolist()
    keys = states["numpy"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, int(position), int(has_cached), cached))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
