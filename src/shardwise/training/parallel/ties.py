"""Tied weights: one parameter under several names, such as a language model's output layer that
shares its embedding's weight (GPT-2, and Hugging Face's `tie_word_embeddings`).

Transforms that replace parameters module by module untie them silently: `to_empty` (giving a
meta model storage) and tensor parallelism give each name a parameter of its own. `retie` makes
the names one parameter again. Pipeline stages are copies of the model, so a tie that spans
stages is a copy on each stage; `StageTies` keeps the copies equal the way Megatron-LM keeps its
first and last stage's embeddings equal: before every optimizer step the copies' gradients are
added up (on one rank, then across the ranks that hold one), so each copy takes the update the
single parameter would, and the gradient norm counts the parameter once.

This module must not decide the layout; it keeps ties through whatever layout was chosen.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from shardwise.common.errors import ConfigError

TieGroup = tuple[str, ...]
"""The names of one parameter, in the model's own order: the first is the canonical one, whose
module initialises it."""

_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module", "module", "_orig_mod")


def clean_name(name: str) -> str:
    """A parameter's name as in the user's model, without the segments wrappers insert
    (activation checkpointing, DDP, compile)."""
    return ".".join(p for p in name.split(".") if p not in _WRAPPER_SEGMENTS)


def tied_groups(model: nn.Module) -> list[TieGroup]:
    """Every parameter that appears under more than one name, as its names."""
    return [group for group in _names_by_parameter(model) if len(group) > 1]


def aliases(groups: list[TieGroup]) -> dict[str, TieGroup]:
    """Each tied name's group."""
    return {name: group for group in groups for name in group}


def retie(module: nn.Module, groups: list[TieGroup]) -> None:
    """Make the names of each group that `module` holds refer to one parameter again: the
    canonical name's (the first present)."""
    slots = _slots(module)
    for group in groups:
        present = [name for name in group if name in slots]
        if len(present) < 2:
            continue
        owner, leaf = slots[present[0]][0]
        keep = owner._parameters[leaf]
        assert keep is not None
        for name in present:
            for other_owner, other_leaf in slots[name]:
                other = other_owner._parameters[other_leaf]
                if other is keep:
                    continue
                assert other is not None
                _check_compatible(present[0], keep, name, other)
                other_owner._parameters[other_leaf] = keep


def _slots(module: nn.Module) -> dict[str, list[tuple[nn.Module, str]]]:
    """Where each parameter name (cleaned of wrapper segments) is held: (module, attribute)."""
    slots: dict[str, list[tuple[nn.Module, str]]] = {}
    for prefix, owner in module.named_modules(remove_duplicate=False):
        for leaf, param in owner._parameters.items():
            if param is not None:
                name = clean_name(f"{prefix}.{leaf}" if prefix else leaf)
                slots.setdefault(name, []).append((owner, leaf))
    return slots


def _check_compatible(name: str, keep: torch.Tensor, other_name: str, other: torch.Tensor) -> None:
    def layout(t: torch.Tensor) -> str:
        if isinstance(t, DTensor):
            return f"{tuple(t.shape)} split as {t.placements} over {t.device_mesh}"
        return f"{tuple(t.shape)} whole"

    same = keep.shape == other.shape and type(keep) is type(other)
    if same and isinstance(keep, DTensor) and isinstance(other, DTensor):
        same = keep.placements == other.placements and keep.device_mesh == other.device_mesh
    if not same:
        raise ConfigError(
            f"'{name}' and '{other_name}' are one tied weight, but the layout gives them "
            f"different shapes ({layout(keep)} vs {layout(other)}); split both the same way in "
            "the tensor-parallel plan (e.g. the embedding rowwise and the output layer "
            "colwise, both along the vocabulary), or untie them in the model"
        )


@dataclass
class StageTie:
    """One tied parameter whose names live on more than one pipeline stage."""

    names: TieGroup
    holders: list[int]
    """The pp ranks (indices in the pp group) that hold a copy, in order."""
    group: dist.ProcessGroup | None = None
    """The holders' process group, when more than one rank holds a copy."""
    params: list[nn.Parameter] = field(default_factory=list)
    """This rank's copies (one per local stage that holds it)."""


@dataclass
class StageTies:
    """The ties that span pipeline stages, and this rank's part in keeping them."""

    ties: list[StageTie]
    pp_rank: int

    def collect(self, stage_modules: Iterable[nn.Module]) -> None:
        """Find this rank's copies in its (parallelized, materialized) stage modules."""
        modules = list(stage_modules)
        for tie in self.ties:
            found: dict[int, nn.Parameter] = {}
            for module in modules:
                named = dict(_named_params(module))
                for name in tie.names:
                    if name in named:
                        found.setdefault(id(named[name]), named[name])
            tie.params = list(found.values())

    def sum_gradients(self) -> None:
        """Give every copy the sum of all copies' gradients: the gradient of the one parameter."""
        for tie in self.ties:
            if not tie.params:
                continue
            grads = [_grad(p) for p in tie.params]
            total = grads[0]
            for grad in grads[1:]:
                total.add_(grad)
            if tie.group is not None:
                dist.all_reduce(total, group=tie.group)
            for grad in grads[1:]:
                grad.copy_(total)

    def not_in_norm(self) -> set[int]:
        """The ids of the copies the gradient norm must skip: all but the first holder's first."""
        skip: set[int] = set()
        for tie in self.ties:
            counted = tie.params[:1] if tie.holders and tie.holders[0] == self.pp_rank else []
            skip.update(id(p) for p in tie.params if not any(p is c for c in counted))
        return skip


def _named_params(module: nn.Module) -> Iterable[tuple[str, nn.Parameter]]:
    for name, param in module.named_parameters(remove_duplicate=False):
        yield clean_name(name), param


def _grad(param: nn.Parameter) -> torch.Tensor:
    """The local tensor of the parameter's gradient (zeros where it got none), to add in place:
    laid out as the parameter is (a vocabulary-split embedding's gradient comes back whole, a
    Replicate DTensor, while the output layer's is split: their local tensors would differ)."""
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    grad = param.grad
    if isinstance(grad, DTensor) and isinstance(param, DTensor):
        if grad.placements != param.placements:
            grad = param.grad = grad.redistribute(param.device_mesh, param.placements)
        return grad.to_local()
    return grad


def spanning_ties(
    model: nn.Module, stage_names: dict[int, set[str]], owner: list[int], pp_rank: int
) -> StageTies:
    """The parameters that more than one pipeline stage holds a copy of: tied weights whose
    names fall in different stages, and any parameter outside the blocks (every stage keeps
    those). `stage_names` are the parameter names each stage holds, `owner` each stage's pp
    rank."""
    ties = []
    for group in _names_by_parameter(model):
        stages = [s for s in sorted(stage_names) if stage_names[s].intersection(group)]
        if len(stages) > 1:
            ties.append(StageTie(names=group, holders=sorted({owner[s] for s in stages})))
    return StageTies(ties, pp_rank)


def connect(ties: StageTies, pp_slices: list[list[int]], pp_group: dist.ProcessGroup) -> None:
    """Give each tie held on more than one rank the process group of its holders. Every rank
    creates every group, in the same order; `pp_slices` are the global ranks of every pipeline
    (one list per pp group, in pp order)."""
    made: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
    for tie in ties.ties:
        holders = tuple(tie.holders)
        if len(holders) < 2:
            continue
        if holders not in made:
            if len(holders) == len(pp_slices[0]):
                made[holders] = pp_group
            else:
                made[holders], _ = dist.new_subgroups_by_enumeration(
                    [[row[h] for h in holders] for row in pp_slices]
                )
        tie.group = made[holders]


def _names_by_parameter(model: nn.Module) -> list[TieGroup]:
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [tuple(group) for group in names.values()]
