"""Pipelines for models that are not a sequence of blocks: torch's tracer
(`torch.distributed.pipelining.pipeline`, built on `torch.export`) records the model's forward
as a graph and cuts it into stages, so a `forward` that calls its parts with code in between (a
reshape, a mask, a residual) pipelines as written.

Where the cuts go, first match wins:
1. `parallel.pipeline_split`: module names; each stage after the first starts where that module
   is called;
2. `pipe_split()` markers (from `torch.distributed.pipelining`) in the model's forward;
3. otherwise the model's repeated layers (the largest list of modules of one type, such as a
   transformer's decoder layers), split into stages of about equal parameter count.

What tracing fixes at trace time, and what shardwise does about it:
- shapes: the graph is recorded for one micro-batch and runs only at that size (a reshape such as
  `x.view(x.size(0), -1)` is recorded with the number). Training always runs micro-batches of
  that size; evaluation pads its last batch to it.
- the training mode: dropout, BatchNorm and attention dropout are recorded as they run in
  training. `follow_training_mode` rewrites them to follow the stage module's `training` flag,
  so evaluation runs them as `model.eval()` would. Other Python branches on `self.training`
  keep the branch they took while tracing.
- tied weights: the tracer gives each stage that uses one a copy of its own (ties.py keeps the
  copies equal).
- values a stage takes from a stage before the one before it (BERT's attention mask): carried
  through the stages between (carry.py), so each stage takes what the one before returns.
- layer types: the stages are graphs, not the model's own layers, so tensor parallelism (whose
  styles apply to layer types) cannot follow; that combination is refused before launch.

This module must not choose the layout: it splits what `parallelize` asks it to.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.export.unflatten import InterpreterModule
from torch.utils._python_dispatch import TorchDispatchMode

from shardwise.common.errors import ConfigError, first_line
from shardwise.training.parallel.carry import carry_skipped_values
from shardwise.training.parallel.pipeline import balance, has_submodule, repeated_layers
from shardwise.training.parallel.ties import tied_groups

GUIDE = "see docs/training.md, 'Pipeline parallelism'"


@dataclass
class TracedSplit:
    """Every stage of a traced pipeline (each rank builds them all, from the meta model, and
    keeps its own)."""

    modules: dict[int, nn.Module]
    held: dict[int, set[str]]
    """The parameter names each stage holds."""
    blocks: dict[int, list[str]]
    """What each stage runs, for display: its repeated layers, or its top-level modules."""
    split: list[str]
    """Where the stages after the first begin (empty for `pipe_split()` markers)."""


def trace_split(
    model: nn.Module,
    example: Any,
    *,
    num_stages: int,
    split: list[str],
    device: torch.device | None = None,
) -> TracedSplit:
    """Trace `model` on `example` (one micro-batch of inputs, on the model's device: meta is
    fine) and cut it into `num_stages` stages, to run on `device`. torch.export's trace is the
    costly part: a model is traced once where its split is named, where a run of its forward on
    the meta device finds no pipe_split() markers, or where the trace with the automatic split
    makes as many stages as asked (markers would have made more); otherwise again without split
    points, to cut at its markers."""
    if split:  # named: the only cuts there may be
        cut = _cut(model, example, split, num_stages, device)
        if len(cut.modules) != num_stages:
            raise ConfigError(
                f"parallel.pipeline_split = {split} cuts {type(model).__name__}'s forward into "
                f"{len(cut.modules)} stages, not parallel.pp × stages_per_rank = {num_stages}: "
                "its forward has pipe_split() markers too, or a named module runs more than "
                "once; remove the markers or name modules that run once"
            )
        return cut
    return _automatic(model, example, num_stages, device)


def _automatic(
    model: nn.Module, example: Any, num_stages: int, device: torch.device | None
) -> TracedSplit:
    """Cut at the forward's pipe_split() markers, or else at its repeated layers."""
    markers = _markers(model, example)
    if markers == 0:
        return _cut(model, example, auto_split(model, num_stages), num_stages, device)
    automatic = None
    if markers is None:  # the meta run could not tell: the automatic split's trace first
        with contextlib.suppress(ConfigError):  # no repeated layers: markers, or the refusal
            automatic = _cut(model, example, auto_split(model, num_stages), num_stages, device)
        if automatic is not None and len(automatic.modules) == num_stages:
            return automatic  # markers would have made more stages
    copied, marked = _traced(model, example, None)
    if marked.num_stages > 1:
        if marked.num_stages != num_stages:
            raise ConfigError(
                f"the model's forward has {marked.num_stages - 1} pipe_split() markers, "
                f"which make {marked.num_stages} stages, but parallel.pp × stages_per_rank "
                f"= {num_stages}; change one to match the other"
            )
        return _stages(marked, copied, [], device)
    # no markers: the automatic split (the refusal of a model with nothing to split)
    return automatic or _cut(model, example, auto_split(model, num_stages), num_stages, device)


def _cut(
    model: nn.Module, example: Any, split: list[str], num_stages: int, device: torch.device | None
) -> TracedSplit:
    """The model traced and cut where the modules `split` names begin."""
    _check_split(model, split, num_stages)
    copied, pipe = _traced(model, example, split)
    return _stages(pipe, copied, split, device)


def _traced(model: nn.Module, example: Any, points: list[str] | None) -> tuple[nn.Module, Any]:
    """A copy of `model` in training mode (split points patch its modules' forward) and torch's
    trace of it cut at `points`."""
    copied = _training_copy(model)
    return copied, _pipeline(copied, example, points)


def _training_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` in training mode: what a run or trace of it changes stays off `model`."""
    copied = copy.deepcopy(model)
    copied.train()
    return copied


def _markers(model: nn.Module, example: Any) -> int | None:
    """How many `pipe_split()` markers the model's forward passes, from one run of a copy of it
    in training mode on the meta device (what it caches on itself stays on the copy); None where
    that cannot tell: a model or batch not on meta (its forward would compute, draw random
    numbers and update statistics) or a forward that cannot run on meta (a Hugging Face model
    reads values)."""
    tensors = [*model.parameters(), *model.buffers(), *torch.utils._pytree.tree_leaves(example)]
    if any(isinstance(t, torch.Tensor) and t.device.type != "meta" for t in tensors):
        return None
    markers = _Markers()
    try:
        copied = _training_copy(model)
        with markers:
            copied(example)
    except Exception:  # any model's code can fail on meta tensors
        return None
    return markers.count


class _Markers(TorchDispatchMode):
    """Counts the `pipe_split()` markers a forward passes."""

    def __init__(self) -> None:
        # here, not at the top: torch.distributed.pipelining imports TorchDynamo (stage.py)
        from torch.distributed.pipelining._IR import aten_pipe_split_alias

        super().__init__()  # type: ignore[no-untyped-call]
        self.marker, self.count = aten_pipe_split_alias, 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if func is self.marker:
            self.count += 1
        return func(*args, **(kwargs or {}))


def auto_split(model: nn.Module, num_stages: int) -> list[str]:
    """The first layer of every stage after the first, the repeated layers balanced by
    parameter count."""
    layers = repeated_layers(model)
    if len(layers) < num_stages:
        found = f"only {len(layers)} repeated layers" if layers else "no repeated layers"
        raise ConfigError(
            f"{type(model).__name__} is not a sequence of blocks (no pipeline_blocks(), not an "
            f"nn.Sequential) and has {found} to split into {num_stages} pipeline stages; name "
            "where stages begin with parallel.pipeline_split = ['module.name', …], put "
            f"pipe_split() markers in its forward, or give it pipeline_blocks() ({GUIDE})"
        )
    costs = [float(sum(p.numel() for p in model.get_submodule(n).parameters())) for n in layers]
    return [layers[i] for i in balance(costs, num_stages)[1:]]


def _check_split(model: nn.Module, split: list[str], num_stages: int) -> None:
    if len(split) != num_stages - 1:
        raise ConfigError(
            f"parallel.pipeline_split names {len(split)} modules but {num_stages} stages need "
            f"{num_stages - 1}: the module each stage after the first begins with"
        )
    names = [n for n, _ in model.named_modules() if n]
    for name in split:
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"parallel.pipeline_split: the model has no module '{name}'{hint}")


def _pipeline(model: nn.Module, example: Any, split: list[str] | None) -> Any:
    # here, not at the top: torch.distributed.pipelining imports TorchDynamo (stage.py)
    from torch.distributed.pipelining import SplitPoint, pipeline

    spec = {name: SplitPoint.BEGINNING for name in split} if split else None
    try:
        with warnings.catch_warnings():  # torch.export's notes on pytree and deprecations
            warnings.simplefilter("ignore")
            return pipeline(model, (example,), split_spec=spec)
    except Exception as e:  # what torch.export raises varies: every failure is a refusal
        cause = e.__cause__ or e
        first = first_line(cause)
        raise ConfigError(
            f"pipeline parallelism could not trace {type(model).__name__}'s forward with "
            f"torch.export ({type(cause).__name__}: {first[:200]}); make the forward "
            f"traceable, or give the model pipeline_blocks() ({GUIDE})"
        ) from e


def _stages(
    pipe: Any, model: nn.Module, split: list[str], device: torch.device | None
) -> TracedSplit:
    layers = repeated_layers(model)
    modules, held, blocks = {}, {}, {}
    with contextlib.suppress(ValueError):  # joined otherwise: the stages' check says how
        carry_skipped_values(pipe)
    for index in range(pipe.num_stages):
        module = pipe.get_stage_module(index)
        keep_the_models_names(module, model)
        follow_training_mode(module)
        if device is not None:
            retarget(module, device)
        modules[index] = module
        held[index] = {n for n, _ in module.named_parameters(remove_duplicate=False)}
        present = [n for n in layers if has_submodule(module, n)]
        blocks[index] = present or [n for n, _ in module.named_children()]
    return TracedSplit(modules=modules, held=held, blocks=blocks, split=split)


def keep_the_models_names(stage: nn.Module, model: nn.Module) -> None:
    """Give a traced stage the state names the model has, so that its checkpoints and exports
    load into the model as written: torch.export keeps one name of a tied parameter (BERT's
    output bias is `cls.predictions.bias` and `cls.predictions.decoder.bias`), so the others
    whose module the stage holds are registered again; and it saves every buffer, so those the
    model does not save (BERT's `position_ids`) are marked so again."""
    modules = dict(stage.named_modules())
    held = {n: p for n, p in stage.named_parameters(remove_duplicate=False)}
    for group in tied_groups(model):
        present = [held[n] for n in group if n in held]
        for name in group:
            owner, _, leaf = name.rpartition(".")
            if present and name not in held and owner in modules:
                modules[owner].register_parameter(leaf, present[0])
    unsaved = {
        f"{prefix}.{name}" if prefix else name
        for prefix, module in model.named_modules()
        for name in module._non_persistent_buffers_set
    }
    for prefix, module in stage.named_modules():
        for name in list(module._buffers):
            if (f"{prefix}.{name}" if prefix else name) in unsaved:
                module._non_persistent_buffers_set.add(name)


# Ops whose training behaviour the trace records as constants: (op, index of the argument).
_TRAIN_FLAG = {
    torch.ops.aten.dropout.default: 2,
    torch.ops.aten.feature_dropout.default: 2,
    torch.ops.aten.alpha_dropout.default: 2,
    torch.ops.aten.feature_alpha_dropout.default: 2,
    torch.ops.aten.batch_norm.default: 5,
}
_SDPA = torch.ops.aten.scaled_dot_product_attention.default


def _count_if_training(counter: torch.Tensor, step: Any, training: bool) -> torch.Tensor:
    """BatchNorm's `num_batches_tracked += 1`, only in training."""
    return counter.add_(step) if training else counter


def _dropout_p_if_training(p: float, training: bool) -> float:
    return p if training else 0.0


def follow_training_mode(stage: nn.Module) -> None:
    """Make every graph in `stage` run dropout, BatchNorm and attention dropout as its module's
    `training` flag says, not as they ran while tracing."""
    _each_graph(stage, _rewrite)


def retarget(stage: nn.Module, device: torch.device) -> None:
    """Make every graph in `stage` run on `device`: tracing (on the meta device) recorded the
    device of the tensors it creates and checks of each tensor's device and dtype. The checks
    go (mixed precision changes dtypes, and they only check), created tensors move."""

    def rewrite(graph: fx.Graph) -> bool:
        changed = False
        for node in list(graph.nodes):
            if node.op != "call_function":
                continue
            if node.target is torch.ops.aten._assert_tensor_metadata.default and not node.users:
                graph.erase_node(node)
                changed = True
            elif "device" in node.kwargs and node.kwargs["device"] != device:
                node.update_kwarg("device", device)
                changed = True
        return changed

    _each_graph(stage, rewrite)


def _each_graph(stage: nn.Module, rewrite: Callable[[fx.Graph], bool]) -> None:
    """Apply `rewrite` to the graph of `stage` and of every module in it, and regenerate the
    code of those it changed."""
    for module in stage.modules():
        if isinstance(module, InterpreterModule) and rewrite(module.graph):
            module.graph.lint()
            module.finalize()
        elif isinstance(module, fx.GraphModule) and rewrite(module.graph):
            module.graph.lint()
            module.recompile()


def _rewrite(graph: fx.Graph) -> bool:
    first = next((n for n in graph.nodes if n.op != "placeholder"), None)
    if first is None:
        return False
    with graph.inserting_before(first), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no underlying reference": a flag, not a tensor
        training = graph.get_attr("training")
    changed = False
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in _TRAIN_FLAG:
            index = _TRAIN_FLAG[node.target]
            if len(node.args) > index and node.args[index] is True:
                node.update_arg(index, training)
                changed = True
        elif node.target is torch.ops.aten.add_.Tensor and _is_batch_counter(node.args[0]):
            node.target = _count_if_training
            node.args = (*node.args[:2], training)
            changed = True
        elif node.target is _SDPA:
            changed |= _rewrite_attention_dropout(graph, node, training)
    if not changed:
        graph.erase_node(training)
    return changed


def _rewrite_attention_dropout(graph: fx.Graph, node: fx.Node, training: fx.Node) -> bool:
    if len(node.args) > 4:
        p = node.args[4]
        if not p:
            return False
        with graph.inserting_before(node):
            node.update_arg(4, graph.call_function(_dropout_p_if_training, (p, training)))
        return True
    p = node.kwargs.get("dropout_p", 0.0)
    if not p:
        return False
    with graph.inserting_before(node):
        node.update_kwarg("dropout_p", graph.call_function(_dropout_p_if_training, (p, training)))
    return True


def _is_batch_counter(node: Any) -> bool:
    return (
        isinstance(node, fx.Node)
        and node.op == "get_attr"
        and str(node.target).endswith("num_batches_tracked")
    )
