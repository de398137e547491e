"""Pipeline parallelism on `torch.distributed.pipelining`: split a model that is a sequence of
blocks into stages, place the stages on the ranks of the `pp` mesh axis, and run a schedule.

What a model needs: to be a sequence of blocks whose outputs feed the next block's input, either an
`nn.Sequential` or a module with `pipeline_blocks() -> list[str]` naming its blocks in order (the
built-in GPT: `embed`, `layers.0` … `layers.N-1`, `final`). A stage is a copy of the model with
the other stages' blocks removed (deleted from a Sequential or ModuleDict, otherwise set to None,
which the model's forward must skip), so parameter names stay those of the whole model and
checkpoints load under any layout.

Placement: single-stage schedules (GPipe, 1F1B) put stage r on pp rank r. Looped schedules
(Interleaved1F1B, LoopedBFS, InterleavedZeroBubble) put stages r, r + pp, r + 2·pp, … on rank r.
V schedules (ZBVZeroBubble, DualPipeV) put stages r and 2·pp − 1 − r on rank r.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise.common.errors import ConfigError
from shardwise.models.hf_pipeline import PassThrough, declared_blocks, pass_through, run_as_stage
from shardwise.training.parallel.ties import StageTies

if TYPE_CHECKING:  # torch.distributed.pipelining is imported when a pipeline starts (stage.py)
    from torch.distributed.pipelining.schedules import _PipelineSchedule

    from shardwise.training.parallel.stage import TimedStage

SINGLE_STAGE = ("GPipe", "1F1B")
LOOPED = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
SCHEDULES = SINGLE_STAGE + LOOPED + V_SHAPED


def pipeline_blocks(model: nn.Module) -> list[str]:
    """The names of the model's blocks, in the order data flows through them: its own
    `pipeline_blocks()`, an `nn.Sequential`'s children, or what a Hugging Face model declares
    (models/hf_pipeline.py)."""
    named = getattr(model, "pipeline_blocks", None)
    if callable(named):
        return list(named())
    if isinstance(model, nn.Sequential):
        return list(model._modules)
    declared = declared_blocks(model)
    if declared:
        return declared
    raise ConfigError(
        f"pipeline parallelism needs a model that is a sequence of blocks; "
        f"{type(model).__name__} is neither an nn.Sequential nor has pipeline_blocks() "
        "(see docs/training.md, 'Pipeline parallelism'); set parallel.pp = 1"
    )


def has_own_blocks(model: nn.Module) -> bool:
    """Whether the model is a sequence of blocks by shardwise's contract (`pipeline_blocks()`,
    or an `nn.Sequential`), whose forward skips the blocks a stage lacks."""
    return callable(getattr(model, "pipeline_blocks", None)) or isinstance(model, nn.Sequential)


def has_blocks(model: nn.Module) -> bool:
    """Whether the model is a sequence of blocks: by shardwise's contract, or by a pipeline
    plan its Hugging Face class declares."""
    return has_own_blocks(model) or bool(declared_blocks(model))


def model_blocks(model: nn.Module) -> list[str]:
    """The units that FSDP shards and activation checkpointing recomputes one at a time: the
    model's own pipeline blocks, or, for any other model, its repeated layers (a transformer's
    decoder layers, also where transformers declares a pipeline plan); none when it has
    neither."""
    return pipeline_blocks(model) if has_own_blocks(model) else repeated_layers(model)


def has_submodule(model: nn.Module, name: str) -> bool:
    """Whether `name` is a module of `model` (a pipeline stage lacks the other stages', or
    holds a pass-through in their place)."""
    try:
        return not isinstance(model.get_submodule(name), PassThrough)
    except AttributeError:
        return False


def repeated_layers(model: nn.Module) -> list[str]:
    """The children of the largest (by parameters) `nn.ModuleList` or `nn.ModuleDict` holding
    two or more modules of one type, e.g. `transformer.h.0` … `transformer.h.11` in GPT-2."""
    best: tuple[int, list[str]] = (0, [])
    for prefix, module in model.named_modules():
        if not isinstance(module, nn.ModuleList | nn.ModuleDict) or len(module) < 2:
            continue
        children = list(module.named_children())
        if len({type(child) for _, child in children}) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        if size > best[0]:
            best = (size, [f"{prefix}.{name}" if prefix else name for name, _ in children])
    return best[1]


def stage_indices(schedule: str, *, pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """The global indices of the stages that live on pp rank `pp_rank`."""
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + i * pp for i in range(stages_per_rank)]


def balance(costs: list[float], num_stages: int) -> list[int]:
    """Split consecutive blocks with these costs into `num_stages` non-empty groups so that the
    most expensive group is as cheap as possible; returns each group's first block index.

    Exact (dynamic programming over split points, O(stages · blocks²)), which is instant for the
    tens to hundreds of blocks models have.
    """
    n = len(costs)
    assert 1 <= num_stages <= n, "validated against the block count before launch"
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][i]: the minimal max-group cost of splitting blocks[:i] into s groups
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for i in range(s, n + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], prefix[i] - prefix[j])
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    starts, i = [], n
    for s in range(num_stages, 0, -1):
        i = cut[s][i]
        starts.append(i)
    return starts[::-1]


def explicit_split(blocks: list[str], split: list[str], num_stages: int) -> list[int]:
    """Stage start indices from `parallel.pipeline_split`: the first block of every stage but the
    first."""
    if len(split) != num_stages - 1:
        raise ConfigError(
            f"parallel.pipeline_split names {len(split)} boundaries but {num_stages} stages need "
            f"{num_stages - 1}; list the first block of every stage after the first"
        )
    starts = [0]
    for name in split:
        if name not in blocks:
            raise ConfigError(
                f"parallel.pipeline_split: '{name}' is not one of the model's blocks "
                f"({', '.join(blocks[:4])}, …)"
            )
        starts.append(blocks.index(name))
    if starts != sorted(set(starts)) or starts[1] == 0:
        raise ConfigError(
            "parallel.pipeline_split: boundaries must be distinct blocks in model order, and "
            "not the first block"
        )
    return starts


def group_blocks(
    model: nn.Module,
    blocks: list[str],
    split: list[str],
    num_stages: int,
    costs: list[float] | None = None,
) -> dict[int, list[str]]:
    """Each stage's consecutive blocks: from `split` (the first block of every stage after the
    first), else balanced by `costs` (default: parameter counts)."""
    if split:
        starts = explicit_split(blocks, split, num_stages)
    else:
        costs = costs or [
            float(sum(p.numel() for p in model.get_submodule(b).parameters())) for b in blocks
        ]
        starts = balance(costs, num_stages)
    bounds = [*starts, len(blocks)]
    return {s: blocks[bounds[s] : bounds[s + 1]] for s in range(num_stages)}


def stage_module(model: nn.Module, blocks: list[str], keep: set[str]) -> nn.Module:
    """A deep copy of `model` holding only the blocks in `keep`: the others removed (the
    model's forward skips them), or, where transformers declares the blocks, passed through."""
    stage = copy.deepcopy(model)
    declared = not has_own_blocks(model)
    for name in blocks:
        if name not in keep:
            _remove(stage, name, pass_through(model, name) if declared else None)
    if declared:
        run_as_stage(stage, first=blocks[0] in keep)
    return stage


def held_names(model: nn.Module, blocks: list[str], keep: set[str]) -> set[str]:
    """The parameter names `stage_module(model, blocks, keep)` holds: all but those under the
    blocks it drops."""
    dropped = tuple(f"{b}." for b in blocks if b not in keep)
    return {
        n for n, _ in model.named_parameters(remove_duplicate=False) if not n.startswith(dropped)
    }


def _remove(model: nn.Module, name: str, stand_in: nn.Module | None) -> None:
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    if stand_in is not None:
        parent._modules[leaf] = stand_in
    elif isinstance(parent, nn.ModuleDict | nn.Sequential | nn.ModuleList):
        del parent._modules[leaf]
    else:
        setattr(parent, leaf, None)


def example_batch(sample: Any, micro_batch: int, device: torch.device) -> torch.Tensor:
    """A micro-batch of copies of one training item's inputs, on `device` (meta is fine)."""
    inputs = sample[0] if isinstance(sample, tuple | list) else sample
    inputs = torch.as_tensor(inputs)
    return inputs.unsqueeze(0).expand(micro_batch, *inputs.shape).contiguous().to(device)


def measure_block_costs(
    template: nn.Module, seed: int, sample: Any, *, micro_batch: int
) -> list[float]:
    """Forward + backward seconds of each block on one micro-batch built from `sample` (a
    training item), measured on rank 0 with the whole model materialized there, and shared with
    every rank so that all of them split the model the same way."""
    costs: list[Any] = [None]
    if dist.get_rank() == 0:
        from shardwise.training.parallel.meta_init import materialize

        model = copy.deepcopy(template)
        # times only: a parameter nothing initialises (under model.init = 'full') is no matter
        materialize([model], template, seed=seed, device=torch.device("cpu"), strict=False)
        h = example_batch(sample, micro_batch, torch.device("cpu"))
        measured = []
        for name in pipeline_blocks(model):
            block = model.get_submodule(name)
            x = h.detach().requires_grad_(h.is_floating_point())
            times = []
            for _ in range(3):
                began = time.perf_counter()
                out = block(x)
                out.float().sum().backward()
                times.append(time.perf_counter() - began)
            measured.append(sorted(times)[1])
            h = out.detach()
        costs = [measured]
    dist.broadcast_object_list(costs, src=0)
    return list(costs[0])


@dataclass
class Pipeline:
    """This rank's share of a pipeline: its stages (by global index) and the schedule."""

    schedule_name: str
    num_stages: int
    num_microbatches: int
    group: dist.ProcessGroup
    owner: list[int]
    """The pp rank (index in `group`) that holds each global stage."""
    modules: dict[int, nn.Module]
    stages: list[TimedStage] = field(default_factory=list)
    block_names: dict[int, list[str]] = field(default_factory=dict)
    """Every stage's blocks (all stages, not only this rank's)."""
    schedule: _PipelineSchedule | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    ties: StageTies = field(default_factory=lambda: StageTies([], 0))
    """Parameters held by more than one stage (tied weights), kept equal across them."""
    static_batch: int | None = None
    """A traced pipeline's stages run only at the batch size they were traced with."""
    _loss_fn: Any = field(default=None, repr=False)
    split_by: str = "blocks"
    """How the model was cut: `blocks` (its own), `declared` (what transformers declares) or
    `traced`."""

    @property
    def pp_rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def has_first(self) -> bool:
        return 0 in self.modules

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.modules

    def start(self, loss_fn: Any, device: torch.device) -> None:
        """Create the stages and the schedule (after the stage modules are parallelized and
        materialized)."""
        from shardwise.training.parallel.stage import TimedStage

        self.device = device
        self.ties.collect(self.modules.values())
        self.stages = [
            TimedStage(module, index, self.num_stages, device, group=self.group)
            for index, module in sorted(self.modules.items())
        ]
        self._loss_fn = loss_fn
        self.reschedule(self.num_microbatches)

    def reschedule(self, num_microbatches: int) -> None:
        """The schedule over this many micro-batches a step (live recovery: a replica's share
        changed with its membership); the stages stay, their buffers made again for it."""
        from torch.distributed.pipelining.schedules import get_schedule_class

        if self.schedule is not None and num_microbatches == self.num_microbatches:
            return
        self.num_microbatches = num_microbatches
        cls = get_schedule_class(self.schedule_name)
        target = self.stages[0] if self.schedule_name in SINGLE_STAGE else self.stages
        # scale_grads: the loss is a mean per micro-batch, so gradients summed over the
        # micro-batches are divided by their number: the gradient of the mean over the batch.
        self.schedule = cls(target, num_microbatches, loss_fn=self._loss_fn, scale_grads=True)

    def busy_seconds(self) -> float:
        return sum(s.busy_seconds for s in self.stages)

    def reset_timers(self) -> None:
        for stage in self.stages:
            stage.busy_seconds = 0.0

    def theoretical_bubble(self) -> float:
        """The idle fraction of an ideal schedule with equal stage times: (p − 1) / (v·m + p − 1)
        for GPipe, 1F1B and the looped schedules with v stages per rank (Narayanan et al., 2021,
        §2.2); the zero-bubble schedules are designed to approach 0."""
        p, m = dist.get_world_size(self.group), self.num_microbatches
        if self.schedule_name in V_SHAPED or self.schedule_name == "InterleavedZeroBubble":
            return 0.0
        v = self.num_stages // p
        return (p - 1) / (v * m + p - 1)


@torch.no_grad()
def pipeline_forward(pipe: Pipeline, inputs: Any) -> torch.Tensor | None:
    """A plain forward pass through every stage in order (for evaluation): any batch size, no
    schedule. Returns the last stage's output on the rank that holds it, None elsewhere.

    A traced pipeline runs only at the batch size it was traced with: the batch goes through in
    pieces of that size, the last one padded with copies of its last sample, and the padding's
    outputs are dropped."""
    size = pipe.static_batch
    if size is None:
        out: torch.Tensor | None = _through_stages(pipe, inputs)
        return out
    count = len(inputs)
    outputs = []
    for start in range(0, count, size):
        piece = inputs[start : start + size]
        if len(piece) < size:
            pad = piece[-1:].expand(size - len(piece), *piece.shape[1:])
            piece = torch.cat([piece, pad])
        outputs.append(_through_stages(pipe, piece))
    if not pipe.has_last:
        return None
    return torch.cat([o for o in outputs if o is not None])[:count]


def _through_stages(pipe: Pipeline, inputs: Any) -> Any:
    me = pipe.pp_rank
    h = inputs
    for index in range(pipe.num_stages):
        if pipe.owner[index] != me:
            continue
        if index > 0 and pipe.owner[index - 1] != me:
            h = _recv(pipe.group, pipe.owner[index - 1], pipe.device)
        h = run_stage(pipe.modules[index], index, h)
        if index < pipe.num_stages - 1 and pipe.owner[index + 1] != me:
            _send(h, pipe.group, pipe.owner[index + 1])
    return h if pipe.has_last else None


def run_stage(stage: nn.Module, index: int, h: Any) -> Any:
    """Stage `index` on what the stage before it returned (the model's input for the first):
    a stage's outputs are the next stage's arguments (several, from a traced stage)."""
    return stage(*h) if index > 0 and isinstance(h, tuple) else stage(h)


_DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
]


def _send(
    values: torch.Tensor | tuple[torch.Tensor, ...], group: dist.ProcessGroup, peer: int
) -> None:
    """Send a tensor, or a tuple of them, to the next stage's rank: a header per tensor (dtype,
    shape), then its data."""
    tensors = values if isinstance(values, tuple) else (values,)
    count = torch.tensor([len(tensors), int(isinstance(values, tuple))], device=tensors[0].device)
    dist.send(count, group=group, group_dst=peer)
    for tensor in tensors:
        header = torch.tensor(
            [_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape], device=tensor.device
        )
        header = torch.nn.functional.pad(header, (0, 8 - len(header)))
        dist.send(header, group=group, group_dst=peer)
        # gloo sends no bool: as bytes
        data = tensor.to(torch.uint8) if tensor.dtype == torch.bool else tensor
        dist.send(data.contiguous(), group=group, group_dst=peer)


def _recv(
    group: dist.ProcessGroup, peer: int, device: torch.device
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    count = torch.zeros(2, dtype=torch.long, device=device)
    dist.recv(count, group=group, group_src=peer)
    tensors = []
    for _ in range(int(count[0])):
        header = torch.zeros(8, dtype=torch.long, device=device)
        dist.recv(header, group=group, group_src=peer)
        dtype, ndim = _DTYPES[int(header[0])], int(header[1])
        wire = torch.uint8 if dtype == torch.bool else dtype
        tensor = torch.empty([int(d) for d in header[2 : 2 + ndim]], dtype=wire, device=device)
        dist.recv(tensor, group=group, group_src=peer)
        tensors.append(tensor.to(dtype))
    return tuple(tensors) if int(count[1]) else tensors[0]
