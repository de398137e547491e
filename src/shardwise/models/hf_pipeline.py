"""Pipelines of Hugging Face models from what transformers declares, so a user writes nothing: a
model's pipeline plan (`pp_plan`: its config's `base_model_pp_plan` and its class's `_pp_plan`)
names the modules data flows through, `{module: (input names, output names)}`, such as Llama's
`model.embed_tokens`, `model.layers`, `model.norm`, `lm_head`. Its blocks are those modules in
the model's own order, a list of layers counting as one block per layer.

A stage is the whole model with the other stages' blocks replaced by `PassThrough` modules, so
the model's own forward runs it: rotary embeddings, masks and the residual stream as transformers
wrote them. The first stage takes the token ids; each later stage takes what the one before it
returned under the name the first block's output has (`inputs_embeds`, where the forward skips
the embedding); every stage returns the one tensor its output holds (`.logits`: on a stage
without the head, the hidden state passed through). The plan is used only where its blocks hold
every parameter of the model (a classification head it does not name would run on every stage);
other models are traced (parallel/traced.py).

No DTensor and no import of transformers here: the launcher checks every job with it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from shardwise.models.hf_init import is_hf


class PassThrough(nn.Module):
    """A block this pipeline stage does not hold: returns its first input as it is."""

    def __init__(self, input_name: str) -> None:
        super().__init__()
        self.input_name = input_name

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return args[0] if args else kwargs[self.input_name]


def declared_blocks(model: nn.Module) -> list[str]:
    """The model's blocks from its declared pipeline plan, in the order of its modules; none
    where it declares none, names a module it lacks, or leaves a parameter outside them."""
    plan = _plan(model)
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    if not plan or any(name not in order for name in plan):
        return []
    blocks: list[str] = []
    for name in sorted(plan, key=order.__getitem__):
        module = model.get_submodule(name)
        if isinstance(module, nn.ModuleList):
            blocks += [f"{name}.{key}" for key in module._modules]
        else:
            blocks.append(name)
    inside = tuple(f"{b}." for b in blocks)
    if any(not n.startswith(inside) for n, _ in model.named_parameters(remove_duplicate=False)):
        return []
    return blocks


def pass_through(model: nn.Module, block: str) -> PassThrough:
    """What stands in for `block` on a stage that does not hold it."""
    plan = _plan(model)
    entry = next(name for name in plan if block == name or block.startswith(f"{name}."))
    return PassThrough(_names(plan[entry])[0])


def run_as_stage(stage: nn.Module, *, first: bool) -> None:
    """Make `stage` (a copy of a model with a declared plan, some blocks passed through) take
    what the stage before it sent and return one tensor."""
    if not first:
        plan = _plan(stage)
        order = {name: i for i, (name, _) in enumerate(stage.named_modules())}
        entry = min(plan, key=order.__getitem__)
        name = _names(plan[entry], outputs=True)[0]
        stage.register_forward_pre_hook(functools.partial(_as_keyword, name=name), with_kwargs=True)
    stage.register_forward_hook(_one_tensor)


def _plan(model: nn.Module) -> dict[str, Any]:
    if not is_hf(model):
        return {}
    plan = getattr(model, "pp_plan", None) or getattr(model, "_pp_plan", None)
    return dict(plan) if isinstance(plan, dict) else {}


def _names(entry: Any, *, outputs: bool = False) -> list[str]:
    """An entry's input (or output) names: `(["input_ids"], ["inputs_embeds"])`."""
    names = entry[1 if outputs else 0]
    return [names] if isinstance(names, str) else list(names)


def _as_keyword(
    _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *, name: str
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    if not args:
        return None
    return (), {**kwargs, name: args[0]}


def _one_tensor(_module: nn.Module, _inputs: Any, output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    return logits if isinstance(logits, torch.Tensor) else output[0]
