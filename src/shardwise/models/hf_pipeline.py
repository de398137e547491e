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
import weakref
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from shardwise.models.hf_init import declared_plan


class PassThrough(nn.Module):
    """A block this pipeline stage does not hold: returns its first input as it is."""

    def __init__(self, input_name: str) -> None:
        super().__init__()
        self.input_name = input_name

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return args[0] if args else kwargs[self.input_name]


def declared_blocks(model: nn.Module) -> list[str]:
    """The model's blocks from its declared pipeline plan, in the order of its modules; none
    where it declares none, names a module it lacks, leaves a parameter outside them, or
    changes the hidden state between them (`passes_through`)."""
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
    return blocks if passes_through(model, blocks) else []


_PASSES: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def passes_through(model: nn.Module, blocks: list[str]) -> bool:
    """Whether the model's forward, with every block passed through, returns the hidden state
    it was given as it is (or a view of it): then a stage, which runs that forward with the
    other stages' blocks passed through, applies its own blocks and nothing else. Llama's does;
    Gemma's scales the embeddings by √hidden, Granite's by a multiplier, Gemma 2's caps the
    logits: run on every stage, those would be applied again and again, so such models are
    traced instead. Decided by one forward of no block on two positions (no values are read:
    meta tensors will do), once per model."""
    if model in _PASSES:
        return _PASSES[model]
    weight = getattr(model.get_submodule(blocks[0]), "weight", None)
    slots = [(model.get_submodule(n.rpartition(".")[0]), n.rpartition(".")[2]) for n in blocks]
    saved = [parent._modules[leaf] for parent, leaf in slots]
    found = False
    if isinstance(weight, torch.Tensor):  # the embedding: the hidden state's width and type
        try:
            for (parent, leaf), block in zip(slots, blocks, strict=True):
                parent._modules[leaf] = pass_through(model, block)
            found = _returns_its_input(model, blocks[0], weight)
        except Exception:  # any model's code can fail here: then it is traced
            found = False
        finally:
            for (parent, leaf), module in zip(slots, saved, strict=True):
                parent._modules[leaf] = module
    _PASSES[model] = found
    return found


def _returns_its_input(model: nn.Module, first: str, weight: torch.Tensor) -> bool:
    """Whether the model (every block passed through) returns the hidden state it takes, on
    fake tensors: transformers skips its checks of values there (a meta model's masks read
    one)."""
    name = _names(_plan(model)[first], outputs=True)[0]
    with FakeTensorMode(allow_non_fake_inputs=True) as fake, torch.no_grad():
        given = torch.zeros(1, 2, weight.shape[-1], dtype=weight.dtype, device=weight.device)
        hidden = fake.from_tensor(given)
        out = _one_tensor(model, (), model(**{name: hidden}))
        return bool(out is hidden or out._base is hidden)


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
    return declared_plan(model, "pp")


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
