"""Tensor parallelism for Hugging Face models (`transformers.PreTrainedModel`, built from a
config: no download): GPT-2-style models, whose layers are `Conv1D` (a linear layer with its
weight stored transposed, (in, out)) and whose query, key and value are one fused projection,
get `gpt2_tp_plan`, chosen automatically when the job names no plan. transformers is an
optional extra (`pip install shardwise[hf]`); nothing here imports it unless the model in hand
is a Hugging Face one, which means it is imported already.

What else a stock model needs (its own initialisation on the meta device, no generation cache)
is models/hf_init.py, apart from DTensor; the loss and evaluation read the `.logits` of the
`ModelOutput` its forward returns (`job_names.model_output`). FSDP finds the decoder layers
itself (parallel.pipeline.repeated_layers), and pipelines trace the model (parallel/traced.py);
tied input and output embeddings stay tied (parallel/ties.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
)
from torch.distributed.tensor.placement_types import _StridedShard

from shardwise.common.errors import ConfigError
from shardwise.models.hf_init import declared_plan, is_hf
from shardwise.models.hf_pipeline import PassThrough


class Conv1DColwise(ColwiseParallel):
    """ColwiseParallel for a `Conv1D`: its weight is (in, out), so the output columns are dim
    1, and the bias is split with them. `fused` projections (GPT-2's query, key and value in one
    layer) are split part by part, so each rank holds its heads of every part: a strided
    placement (stored whole in checkpoints, see trainer/state.py); their bias stays whole."""

    layer_types: tuple[type[nn.Module], ...] = ()  # (Conv1D,) once made: transformers is loaded
    weight_dim = 1  # the weight's dimension it splits (checked against tp before launch)

    def __init__(self, *, fused: int = 1) -> None:
        super().__init__()
        self.fused = fused
        self.layer_types = (_conv1d(),)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        weight: Placement = (
            _StridedShard(1, split_factor=self.fused) if self.fused > 1 else Shard(1)
        )
        # A fused bias stays whole (each rank slices it in the add): split strided on the dim
        # FSDP also shards, it would come back wrong from FSDP's gather.
        bias: Placement = Replicate() if self.fused > 1 else Shard(0)
        _distribute(module, device_mesh, {"weight": weight, "bias": bias})
        module.register_forward_pre_hook(
            partial(_replicated_input, device_mesh=device_mesh), prepend=True
        )
        module.register_forward_hook(_local_output)
        return module


class Conv1DRowwise(RowwiseParallel):
    """RowwiseParallel for a `Conv1D`: its input rows are dim 0 of the weight; the bias stays
    whole and is added once, after the partial sums are reduced."""

    layer_types: tuple[type[nn.Module], ...] = ()
    weight_dim = 0

    def __init__(self) -> None:
        super().__init__(output_layouts=Replicate())
        self.layer_types = (_conv1d(),)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _distribute(module, device_mesh, {"weight": Shard(0), "bias": Replicate()})
        module.register_forward_pre_hook(
            partial(_sharded_input, device_mesh=device_mesh), prepend=True
        )
        module.register_forward_hook(_replicated_output)
        return module


class LocalHeads(ParallelStyle):
    """GPT-2's attention splits its fused projection by `split_size`, the width of one part:
    under tensor parallelism a rank holds 1/tp of every part, so its own width (and its head
    count) is 1/tp of the model's."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp = device_mesh.size()
        for name in ("split_size", "num_heads", "embed_dim"):
            setattr(module, name, int(getattr(module, name)) // tp)
        return module


def gpt2_tp_plan(model: nn.Module, *, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """Megatron-LM's split of a GPT-2-style model (`GPT2LMHeadModel`, `GPT2Model`): the token
    embedding and the (tied) output layer by vocabulary rows, each block's fused query/key/value
    and first MLP layer by output columns (by heads), its attention output and second MLP layer
    by input rows, one all-reduce after each; position embeddings and norms stay whole."""
    if sequence_parallel:
        raise ConfigError(
            "parallel.sequence_parallel is not available for GPT-2-style Hugging Face models "
            "(shardwise's plan splits them Megatron-style only); set it to false"
        )
    names = {name for name, _ in model.named_modules()}
    plan: dict[str, ParallelStyle] = {}
    for name, module in model.named_modules():
        if name.endswith(".attn") and hasattr(module, "c_attn") and hasattr(module, "split_size"):
            plan[f"{name}.c_attn"] = Conv1DColwise(fused=3)
            plan[f"{name}.c_proj"] = Conv1DRowwise()
            plan[name] = LocalHeads()
        elif name.endswith(".mlp") and hasattr(module, "c_fc"):
            plan[f"{name}.c_fc"] = Conv1DColwise()
            plan[f"{name}.c_proj"] = Conv1DRowwise()
        elif name.endswith("wte") and isinstance(module, nn.Embedding):
            plan[name] = RowwiseParallel(input_layouts=Replicate())
    if "lm_head" in names:
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    return plan


def declared_tp_plan(
    model: nn.Module, *, sequence_parallel: bool = False
) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan transformers declares for the model (`base_model_tp_plan` and
    its class's `_tp_plan`: Llama's query, key, value and MLP input projections by columns, the
    attention output and MLP output by rows, the embedding and output layer by vocabulary), its
    `*` wildcards matched against the model's modules and its style names turned into torch's
    styles."""
    name = type(model).__name__
    if sequence_parallel:
        raise ConfigError(
            f"parallel.sequence_parallel is not available with the tensor-parallel plan "
            f"transformers declares for {name}; set it to false, or bring a plan of your own "
            "(parallel.tp_plan)"
        )
    # a pipeline stage holds pass-throughs in place of the blocks it lacks: nothing to split
    modules = [n for n, m in model.named_modules() if not isinstance(m, PassThrough)]
    plan: dict[str, ParallelStyle] = {}
    for pattern, style in declared_plan(model, "tp").items():
        make = _DECLARED_STYLES.get(style)
        if make is None:
            raise ConfigError(
                f"transformers' tensor-parallel plan for {name} splits '{pattern}' as "
                f"'{style}', which shardwise does not translate into torch's styles (it does "
                f"{', '.join(_DECLARED_STYLES)}); set parallel.tp_plan = "
                "'package.module:function' (see docs/training.md, 'Tensor parallelism')"
            )
        found = re.compile(re.escape(pattern).replace(r"\*", r"[^.]+"))
        plan |= {m: make() for m in modules if found.fullmatch(m)}
    return plan


_DECLARED_STYLES: dict[str, Callable[[], ParallelStyle]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
}
"""transformers' style names (transformers/integrations/tensor_parallel.py) that have a torch
style doing the same: a column split whose output stays split, a row split whose output is
summed, a column split gathered (the output layer), and an embedding split by vocabulary rows."""


def encoder_tp_plan(
    model: nn.Module, *, sequence_parallel: bool = False
) -> dict[str, ParallelStyle]:
    """Megatron-LM's split of a BERT-style encoder, which transformers declares no plan for:
    each layer's query, key and value and its MLP input by columns (by heads), its attention
    output and MLP output by rows; embeddings, norms and heads stay whole."""
    if sequence_parallel:
        raise ConfigError(
            f"parallel.sequence_parallel is not available for {type(model).__name__} "
            "(shardwise's plan for BERT-style encoders splits them Megatron-style only); set it "
            "to false"
        )
    names = {name for name, _ in model.named_modules()}
    plan: dict[str, ParallelStyle] = {}
    for name, module in model.named_modules():
        parent = name.rpartition(".")[0]
        if _has_linears(module, "query", "key", "value") and f"{parent}.output.dense" in names:
            plan |= {f"{name}.{p}": ColwiseParallel() for p in ("query", "key", "value")}
            plan[f"{parent}.output.dense"] = RowwiseParallel()
        elif name.endswith(".intermediate") and f"{parent}.output.dense" in names:
            plan[f"{name}.dense"] = ColwiseParallel()
            plan[f"{parent}.output.dense"] = RowwiseParallel()
    return plan


def _has_linears(module: nn.Module, *names: str) -> bool:
    return all(isinstance(getattr(module, n, None), nn.Linear) for n in names)


def default_tp_plan(model: nn.Module) -> tuple[Callable[..., dict[str, ParallelStyle]], str] | None:
    """The plan for a Hugging Face model when the job names none, and where it comes from: the
    one transformers declares; for GPT-2-style models (Conv1D layers, fused attention
    projections), which torch's styles cannot split, shardwise's; for BERT-style encoders,
    which declare none, shardwise's Megatron split."""
    if not is_hf(model):
        return None
    if any(type(m) is _conv1d() for m in model.modules()):
        return gpt2_tp_plan, "shardwise's plan for Hugging Face GPT-2 models"
    if declared_plan(model, "tp"):
        return declared_tp_plan, f"the plan transformers declares for {type(model).__name__}"
    if encoder_tp_plan(model):
        return encoder_tp_plan, "shardwise's plan for BERT-style encoders"
    return None


def _conv1d() -> type[nn.Module]:
    from transformers.pytorch_utils import Conv1D

    conv1d: type[nn.Module] = Conv1D
    return conv1d


def _distribute(module: nn.Module, mesh: DeviceMesh, placements: dict[str, Placement]) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        split = distribute_tensor(param, mesh, [placements[name]], src_data_rank=None)
        module.register_parameter(name, nn.Parameter(split, requires_grad=param.requires_grad))


def _replicated_input(module: nn.Module, inputs: Any, *, device_mesh: DeviceMesh) -> Any:
    x = inputs[0]
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
    return (x, *inputs[1:])


def _sharded_input(module: nn.Module, inputs: Any, *, device_mesh: DeviceMesh) -> Any:
    x = inputs[0]
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, device_mesh, [Shard(-1)], run_check=False)
    return (x, *inputs[1:])


def _local_output(module: nn.Module, inputs: Any, output: Any) -> Any:
    return output.to_local() if isinstance(output, DTensor) else output


def _replicated_output(module: nn.Module, inputs: Any, output: Any) -> Any:
    if isinstance(output, DTensor):
        return output.redistribute(placements=[Replicate()]).to_local()
    return output
