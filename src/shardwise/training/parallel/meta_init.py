"""Meta-device initialisation: a model is built without memory (on the `meta` device), split and
sharded, and only then given storage, so each rank only ever holds its own shard and a model larger
than one rank's memory can start.

Values do not depend on the layout. Each module that owns parameters is initialised on its own, on
the CPU, at full size, from a generator seeded by (job seed, module name); then each rank keeps
its slice. So FSDP on 8 ranks, TP × PP on 4 and a single process start from bitwise the same
weights, and peak memory is this rank's shard plus the largest single module.

A module is initialised by its own `reset_parameters()` (every torch layer has one) and then, if
the model defines `init_weights(module)`, by that (the built-in GPT does: GPT-2's init); a
Hugging Face model by its own `_init_weights` (models/hf_init.py).
This module must not decide the layout; it fills in whatever layout `parallelize` produced.
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from shardwise.common.errors import ConfigError
from shardwise.models.hf_init import initializer as hf_initializer
from shardwise.training.parallel.ties import aliases, clean_name, retie, tied_groups


def module_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % 2**63


def initializer(model: nn.Module) -> Callable[[str, nn.Module], None] | None:
    """How to initialise one module of `model` (by its name) after its `reset_parameters()`:
    the model's `init_weights(module)` (shardwise's contract; the built-in GPT has one), or a
    Hugging Face model's own scheme; None when the model brings neither."""
    own = getattr(model, "init_weights", None)
    if callable(own) and _takes_one_argument(own):
        return lambda _name, module: own(module)
    hf = hf_initializer(model)
    if hf is not None:
        return lambda name, _module: hf(name)
    return None


def supports_meta_init(model: nn.Module) -> bool:
    """True when the model brings an initializer (see `initializer`), or every parameter
    belongs to a module that can re-initialise it (`reset_parameters()`)."""
    if initializer(model) is not None:
        return True
    return all(callable(getattr(m, "reset_parameters", None)) for _, m in _owning_modules(model))


def _takes_one_argument(fn: Callable[..., Any]) -> bool:
    try:
        inspect.signature(fn).bind(None)
    except (TypeError, ValueError):
        return False
    return True


def materialize(
    parts: list[nn.Module],
    template: nn.Module,
    *,
    seed: int,
    device: torch.device,
    strict: bool = True,
) -> None:
    """Give the (parallelized, meta) `parts` storage on `device` and fill every parameter and
    buffer with this rank's slice of the value the unsharded `template` would get: a
    parameter's from its module's initialisers, a buffer's from the template (built with
    `job_names.build_with_meta_parameters`, its buffers as `__init__` computed them) and then
    from those initialisers. The template's tensors are given back to it (an initialiser of a
    parent module may write the template's own real buffers, with the values they hold).

    A name may be held by several parts (two pipeline stages on one rank both hold what is
    outside their blocks): each copy is filled. A tied parameter takes the value its first
    name's module gives it, on every stage that holds one of its names, as in the built model
    (the output layer holds the embedding). A parameter that no initialiser sets is refused
    (`strict`), so a run never starts from uninitialised memory; not strict, it is left NaN,
    for a run whose weights are loaded next (a resumed run, `model.init_from`)."""
    groups = tied_groups(template)
    tied = aliases(groups)
    targets: dict[str, list[torch.Tensor]] = {}
    for part in parts:
        part.to_empty(device=device)
        retie(part, groups)  # to_empty gave every name a parameter of its own
        for name, tensor in itertools.chain(part.named_parameters(), part.named_buffers()):
            targets.setdefault(clean_name(name), []).append(tensor)
    for group in groups:  # the first name's value goes to every name of the group held here
        targets[group[0]] = [t for name in group for t in targets.get(name, [])]
    init_module = initializer(template)
    scratch = _Scratch()
    for prefix, module in _owning_modules(template):
        own = [(n, t) for n, t in _own_tensors(module, prefix) if tied.get(n, (n,))[0] == n]
        if not any(targets.get(name) for name, _ in own):
            continue  # another pipeline stage owns it, or it is a tied parameter's second name
        kept = scratch.attach(module)
        _initialise(module, prefix, seed, init_module)
        with torch.no_grad():  # the module's tensors now (attach gave it storage)
            for name, full in _own_tensors(module, prefix):
                if tied.get(name, (name,))[0] != name:
                    continue
                held = kept.get(name.rpartition(".")[2])
                if strict and (held is None or held.is_meta):
                    _check_initialised(template, module, name, full)
                for target in targets.get(name, []):
                    copy_slice(full, target)
        scratch.detach(module, kept)


def _check_initialised(
    template: nn.Module, module: nn.Module, name: str, tensor: torch.Tensor
) -> None:
    """A parameter (or a buffer the template has no value for) still holding the scratch's NaN
    was set by no initialiser."""
    if tensor.is_floating_point() and bool(tensor.isnan().any()):
        scheme = "_init_weights" if hf_initializer(template) else "init_weights"
        raise ConfigError(
            f"model.init = 'meta': nothing initialises {name} ({type(module).__name__} has no "
            f"reset_parameters() that sets it, nor does {type(template).__name__}."
            f"{scheme}(module)); set it in one of them, or set model.init = 'full'"
        )


def _initialise(
    module: nn.Module, prefix: str, seed: int, init_module: Callable[..., Any] | None
) -> None:
    """The module's own initial values, from its own seed (the same whatever the layout)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(module_seed(seed, prefix))
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()
        if init_module is not None:
            init_module(prefix, module)


class _Scratch:
    """One reusable CPU buffer per dtype for the full-size copy of the module being initialised.
    Allocating and freeing a full-size copy per module instead lets the C allocator keep the
    freed memory (measured: a 400 MB model sharded over 2 ranks grew each rank by 450 MB, not
    200), which defeats the point of initialising on the meta device."""

    def __init__(self) -> None:
        self._buffers: dict[torch.dtype, torch.Tensor] = {}

    def attach(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """Point the module's own meta parameters and buffers at views of the scratch buffers,
        filled with NaN (integers with 0) so that what no initialiser sets shows; a buffer the
        template holds a value for starts with that value. Returns what the module held."""
        kept = {**module._parameters, **module._buffers}
        own = [(n, t) for n, t in kept.items() if t is not None and t.is_meta]
        needed: dict[torch.dtype, int] = {}
        for _, t in own:
            needed[t.dtype] = needed.get(t.dtype, 0) + t.numel()
        offsets = dict.fromkeys(needed, 0)
        for name, t in own:
            buffer = self._buffer(t.dtype, needed[t.dtype])
            start = offsets[t.dtype]
            view = buffer[start : start + t.numel()].view(t.shape)
            view.fill_(torch.nan if view.is_floating_point() else 0)
            offsets[t.dtype] += t.numel()
            if name in module._parameters:
                module._parameters[name] = nn.Parameter(view, requires_grad=t.requires_grad)
            else:
                module._buffers[name] = view
        held = {name: t for name, t in kept.items() if t is not None}
        for name, t in held.items():  # a real buffer: a copy, which the initialisers may set
            if not t.is_meta and name in module._buffers:
                module._buffers[name] = t.clone()
        return held

    def detach(self, module: nn.Module, kept: dict[str, torch.Tensor]) -> None:
        """Give the module back what it held before `attach`."""
        for name, t in kept.items():
            if name in module._parameters:
                module._parameters[name] = t  # type: ignore[assignment]
            else:
                module._buffers[name] = t

    def _buffer(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        buffer = self._buffers.get(dtype)
        if buffer is None or buffer.numel() < numel:
            buffer = self._buffers[dtype] = torch.empty(numel, dtype=dtype)
        return buffer


def copy_slice(full: torch.Tensor, target: torch.Tensor) -> None:
    """Copy into `target` its part of `full`: all of it for a plain tensor, this rank's shard for
    a DTensor (sliced locally, no communication: every rank holds the same `full`)."""
    if not isinstance(target, DTensor):
        target.copy_(full)
    elif any(isinstance(p, _StridedShard) for p in target.placements):
        # a strided shard is several pieces of `full`: let DTensor cut them
        mine = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(mine.to_local())
    else:  # one block: a view of `full`, nothing allocated
        shape, offset = compute_local_shape_and_global_offset(
            full.shape, target.device_mesh, target.placements
        )
        index = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
        target.to_local().copy_(full[index])


def _owning_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for prefix, module in model.named_modules():
        if next(itertools.chain(module.parameters(False), module.buffers(False)), None) is not None:
            yield prefix, module


def _own_tensors(module: nn.Module, prefix: str) -> list[tuple[str, torch.Tensor]]:
    tensors = itertools.chain(
        module.named_parameters(recurse=False), module.named_buffers(recurse=False)
    )
    return [(f"{prefix}.{n}" if prefix else n, t) for n, t in tensors]
