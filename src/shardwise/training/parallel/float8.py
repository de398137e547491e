"""Float8 training (`train.float8`) through torchao: the model's linear layers swapped for
torchao's `Float8Linear`, which casts its input, weight and output gradient to float8 (with
dynamic scales) for the three matrix multiplies of each layer and keeps the weights in their
own precision, so the optimizer and the checkpoints see what they always see.

Which layers: `train.float8_layers = "auto"` converts the linears torchao's own measurements
say gain on an H100 (large enough in both dimensions for the recipe); a list of names (globs on
the module's qualified name, `*.mlp.up`) converts those. Either way a layer whose dimensions do
not divide by 16 (float8's matrix multiply needs them to) is never converted. The start line
lists the layers converted.

Order: converted before tensor parallel, activation checkpointing, compile and `fully_shard`
(parallel/apply.py), so that FSDP2 can all-gather float8 weights
(`train.float8_all_gather`), whose scales are then computed for every weight in one
all-reduce after each optimizer step (`after_optimizer_step`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import logging
from typing import Any, cast

import torch
from torch import nn

from shardwise.common.errors import ConfigError

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def smallest_gaining(recipe: str, k: int, n: int) -> bool:
    """Whether a linear of `k` inputs and `n` outputs is large enough for float8 to gain under
    `recipe`: torchao's thresholds, measured on an H100 (its `_auto_filter_for_recipe`); below
    them the casts cost more than the faster matrix multiply saves."""
    if recipe == "tensorwise":
        return not (k <= 4096 and n <= 1024)
    return not (n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048))


@dataclasses.dataclass(frozen=True)
class Float8:
    """What `train.float8` and its keys ask for."""

    recipe: str
    layers: str | list[str]
    emulate: bool
    all_gather: bool

    @classmethod
    def of(cls, train: Any) -> Float8 | None:
        """From the job's `[train]` section; None where float8 is off."""
        if train.float8 == "off":
            return None
        return cls(train.float8, train.float8_layers, train.float8_emulate,
                   train.float8_all_gather)  # fmt: skip


def chosen(model: nn.Module, recipe: str, layers: str | list[str]) -> tuple[list[str], list[str]]:
    """The qualified names of the linears to convert, and of those left out with the reason
    (`name (why)`). A name in `layers` that matches no linear is a `ConfigError`."""
    linears = {n: m for n, m in model.named_modules() if type(m) is nn.Linear}
    if layers == "auto":
        wanted = list(linears)
    else:
        wanted = []
        for pattern in layers:
            matched = [n for n in linears if fnmatch.fnmatchcase(n, pattern)]
            if not matched:
                some = ", ".join(list(linears)[:6]) or "none"
                raise ConfigError(
                    f"train.float8_layers: '{pattern}' names no linear layer of the model (its "
                    f"linears: {some}{', …' if len(linears) > 6 else ''})"
                )
            wanted += [n for n in matched if n not in wanted]
    take, left = [], []
    for name in wanted:
        module = linears[name]
        k, n = module.in_features, module.out_features
        if k % 16 or n % 16:
            left.append(f"{name} ({k}×{n}: not multiples of 16)")
        elif layers == "auto" and not smallest_gaining(recipe, k, n):
            left.append(f"{name} ({k}×{n}: too small to gain)")
        else:
            take.append(name)
    return take, left


def convert(model: nn.Module, plan: Float8, *, compiled: bool) -> list[str]:
    """Swap the chosen linears (`chosen`) for torchao's float8 ones, in place; lines for the
    start of the run (`compiled`: whether train.compile is on; a warning where it is not).
    Attributes the model set on a layer (the built-in GPT's `init_std` on its residual
    projections, read when its weights are initialised after sharding) are kept."""
    torchao_float8 = _torchao_float8()
    Float8LinearConfig = torchao_float8.Float8LinearConfig  # noqa: N806
    convert_to_float8_training = torchao_float8.convert_to_float8_training
    recipe, emulate, all_gather = plan.recipe, plan.emulate, plan.all_gather
    take, left = chosen(model, recipe, plan.layers)
    config = Float8LinearConfig.from_recipe_name(recipe)
    config = dataclasses.replace(config, emulate=emulate, enable_fsdp_float8_all_gather=all_gather)
    kept = {name: _own_attributes(model.get_submodule(name)) for name in take}
    if take:
        names = set(take)
        convert_to_float8_training(
            model, module_filter_fn=lambda _, fqn: fqn in names, config=config
        )
    for name, attributes in kept.items():
        module = model.get_submodule(name)
        for key, value in attributes.items():
            setattr(module, key, value)
    said = f"float8 ({recipe}{', emulated' if emulate else ''}"
    said += f"{', float8 all-gather' if all_gather else ''}): "
    said += f"{len(take)} linear layer{'s' if len(take) != 1 else ''} converted"
    lines = [said + (f": {_listed(take)}" if take else "")]
    if left:
        lines.append(f"float8: {len(left)} left in their precision: {_listed(left)}")
    if not compiled:
        lines.append(
            "float8: train.compile is off, and float8 runs slower than bf16 uncompiled (its "
            "casts and scales are kernels of their own): set train.compile = true"
        )
    return lines


@functools.cache
def _torchao_float8() -> Any:
    """`torchao.float8`, imported without what torchao logs on a machine without its GPU
    kernels (that they do not load: float8 training does not use them)."""
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.ERROR)
    try:
        import torchao.float8
    except ImportError:
        raise ConfigError(
            "train.float8 needs torchao: pip install 'shardwise[float8]' (torchao 0.18), or set "
            "train.float8 = 'off'"
        ) from None
    finally:
        for logger, level in zip(quiet, levels, strict=True):
            logger.setLevel(level)
    return torchao.float8


def _listed(names: list[str], most: int = 8) -> str:
    more = f", … ({len(names) - most} more)" if len(names) > most else ""
    return ", ".join(names[:most]) + more


_LINEAR_ATTRIBUTES = frozenset(vars(nn.Linear(1, 1, device="meta")))
"""The attributes every nn.Linear has (in_features, training, …)."""


def _own_attributes(module: nn.Module) -> dict[str, Any]:
    """What a model set on a layer beyond nn.Linear's own attributes."""
    return {
        k: v
        for k, v in vars(module).items()
        if not k.startswith("_") and k not in _LINEAR_ATTRIBUTES and not isinstance(v, nn.Module)
    }


def after_optimizer_step(parts: list[nn.Module]) -> None:
    """With the float8 all-gather, every sharded float8 weight's scale for the next forward,
    in one all-reduce (torchao's `precompute_float8_dynamic_scale_for_fsdp`)."""
    precompute = _torchao_float8().precompute_float8_dynamic_scale_for_fsdp
    for part in parts:
        precompute(part)


def check_gloo_units(parts: list[nn.Module]) -> None:
    """gloo cannot all-gather float8: an FSDP unit whose parameters are all float8 weights (no
    bias, no norm beside them) would fail at its first forward with "Invalid scalar type"
    (where a unit mixes dtypes, FSDP2 all-gathers bytes, which gloo can)."""
    from torch.distributed.fsdp import FSDPModule

    _torchao_float8()  # imported quietly
    from torchao.float8.float8_linear import Float8Linear as float8_linear  # noqa: N813

    for part in parts:
        for name, unit in part.named_modules():
            if not isinstance(unit, FSDPModule):
                continue
            own, weights = [], set()
            stack: list[nn.Module] = [cast(nn.Module, unit)]  # an FSDPModule is a Module
            while stack:  # the unit's modules, not those of the units inside it
                module = stack.pop()
                own += list(module.parameters(recurse=False))
                if isinstance(module, float8_linear):
                    weights.add(id(module.weight))
                stack += [c for c in module.children() if not isinstance(c, FSDPModule)]
            if own and all(id(p) in weights for p in own):
                raise ConfigError(
                    f"train.float8_all_gather: the FSDP unit '{name or 'the model'}' holds only "
                    "bias-free float8 linears, which gloo (CPU) cannot all-gather in float8; "
                    "drop train.float8_all_gather on CPUs"
                )


def check_device(device: torch.device, *, emulate: bool) -> None:
    """Float8 matrix multiplies need a GPU of compute capability 8.9 or above (Ada, Hopper,
    Blackwell); elsewhere only torchao's emulation runs."""
    if device.type != "cuda" or emulate:
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ConfigError(
            f"train.float8 needs a GPU of compute capability 8.9 or above (this one: "
            f"{major}.{minor}); set train.float8_emulate = true to check numerics, or "
            "train.float8 = 'off'"
        )
