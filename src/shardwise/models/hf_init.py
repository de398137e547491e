"""Hugging Face models (`transformers.PreTrainedModel`) as they are built, and what a stock
model needs to train:
- initialisation on the meta device with Hugging Face's own scheme: `_init_weights(module)` for
  a module, then for each module above it (Hugging Face initialises children before parents,
  and a parent may initialise a child again: GPT-2 scales its residual projections by
  1/sqrt(2·layers));
- no generation cache while training (`config.use_cache = False`: it only holds memory).

No DTensor here (its import takes 0.5 s): the launcher builds every model on the meta device to
check the job, and needs none of it. Tensor parallelism for these models is models/hf.py.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from torch import nn


def is_hf(model: nn.Module) -> bool:
    """Whether `model` is a Hugging Face `PreTrainedModel`."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def declared_plan(model: nn.Module, kind: str) -> dict[str, Any]:
    """A parallel plan transformers declares for a Hugging Face model (`kind`: `tp` or `pp`):
    the instance's (`tp_plan`, with its config's base-model plan merged in), or its class's
    (`_tp_plan`); empty for any other model or where it declares none."""
    if not is_hf(model):
        return {}
    plan = getattr(model, f"{kind}_plan", None)
    if not isinstance(plan, dict):
        plan = getattr(model, f"_{kind}_plan", None)
    return dict(plan) if isinstance(plan, dict) else {}


def prepare(model: nn.Module) -> None:
    """Training settings a stock model needs: no generation cache."""
    config: Any = getattr(model, "config", None)
    if is_hf(model) and getattr(config, "use_cache", False):
        config.use_cache = False


def initializer(model: nn.Module) -> Callable[[str], None] | None:
    """Hugging Face's initialisation of the module named `name`: its `_init_weights` on that
    module, then on every module above it, nearest first (None for other models). On a model
    whose parameters are on the meta device only the module being initialised has parameters
    with storage, so the parents' calls set nothing else (but the buffers `__init__` computed,
    which they set to the same values: BERT's position ids)."""
    if not is_hf(model):
        return None
    init_weights: Callable[[nn.Module], None] = getattr(model, "_init_weights")  # noqa: B009

    def init(name: str) -> None:
        parts = name.split(".") if name else []
        for depth in range(len(parts), -1, -1):
            init_weights(model.get_submodule(".".join(parts[:depth])))

    return init
