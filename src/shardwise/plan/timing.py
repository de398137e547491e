"""Time per step and per run: compute at a stated utilisation of the peak (or a calibrated rate),
each collective with a latency–bandwidth (α–β) model on the link it crosses, and the pipeline
bubble of the schedule.

What overlaps with what (stated, not measured):
- tensor-parallel all-reduces (2 in forward, 2 in backward per layer and micro-batch; 2 more with
  full recomputation) sit between dependent matrix multiplies: never overlapped;
- pipeline sends (one activation forward, one gradient back per micro-batch and stage boundary):
  not overlapped (an upper bound; they are small);
- data-parallel gradient sync (all-reduce, or reduce-scatter + all-gather under ZeRO) overlaps
  with the backward pass, ZeRO-3's parameter all-gathers with forward and backward, up to the
  hardware's `overlap` fraction of that compute; the rest is exposed;
- the optimizer step is memory-bound and runs after everything else.

Ranks are placed tensor-parallel innermost, then data-parallel, then pipeline (Megatron-LM's
order): a tensor-parallel group stays inside a node when tp ≤ GPUs per node; data-parallel and
pipeline traffic crosses nodes once the groups inside them outgrow a node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardwise.plan.hardware import Hardware
from shardwise.plan.layout import Layout, Precision
from shardwise.plan.model import Transformer


@dataclass(frozen=True)
class Link:
    bandwidth: float
    latency: float


def all_reduce(size: float, n: int, link: Link) -> float:
    """Ring: 2(n−1) steps of size/n each; a tree (log-depth, whole-size transfers) wins for
    small messages. The faster of the two, as NCCL picks."""
    if n <= 1 or size <= 0:
        return 0.0
    ring = 2 * (n - 1) * link.latency + 2 * (n - 1) / n * size / link.bandwidth
    tree = 2 * math.ceil(math.log2(n)) * link.latency + 2 * size / link.bandwidth
    return min(ring, tree)


def all_gather(size: float, n: int, link: Link) -> float:
    """Ring all-gather (or reduce-scatter) of a `size`-byte whole: (n−1) steps of size/n."""
    if n <= 1 or size <= 0:
        return 0.0
    return (n - 1) * link.latency + (n - 1) / n * size / link.bandwidth


reduce_scatter = all_gather


def send(size: float, link: Link) -> float:
    return link.latency + size / link.bandwidth


def bubble_fraction(schedule: str, pp: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """Idle time over useful time: (p − 1)/m for GPipe and 1F1B, (p − 1)/(v·m) for the
    interleaved schedules (Narayanan et al. 2021, §2.2); the zero-bubble schedules split the
    backward pass to fill about two thirds of 1F1B's bubble (Qi et al. 2023, ZB-H1)."""
    if pp <= 1:
        return 0.0
    p, m, v = pp, microbatches, stages_per_rank
    if schedule in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"):
        return (p - 1) / (3 * v * m)
    if v > 1:
        return (p - 1) / (v * m)
    return (p - 1) / m


@dataclass(frozen=True)
class StepTime:
    compute: float
    bubble: float
    tensor_parallel: float
    pipeline: float
    data_parallel: float
    """All data-parallel communication; `exposed` of it is not hidden behind compute."""
    exposed: float
    optimizer: float

    @property
    def total(self) -> float:
        return (
            self.compute + self.bubble + self.tensor_parallel + self.pipeline + self.exposed
        ) + self.optimizer

    def terms(self) -> dict[str, float]:
        return {
            "compute": self.compute,
            "pipeline bubble": self.bubble,
            "tensor-parallel comm": self.tensor_parallel,
            "pipeline comm": self.pipeline,
            "data-parallel comm (exposed)": self.exposed,
            "optimizer step": self.optimizer,
        }

    def dominant(self) -> str:
        return max(self.terms().items(), key=lambda kv: kv[1])[0]


def links(layout: Layout, hardware: Hardware) -> tuple[Link, Link, Link]:
    """The links tensor-, data- and pipeline-parallel traffic crosses."""
    node = hardware.gpus_per_node
    intra = Link(hardware.intra_bandwidth, hardware.intra_latency)
    inter = Link(hardware.inter_bandwidth, hardware.inter_latency)
    tp = intra if layout.tp <= node else inter
    dp = intra if layout.tp * layout.dp <= node else inter
    pp = intra if layout.devices <= node else inter
    return tp, dp, pp


def flops_rate(hardware: Hardware) -> float:
    return hardware.peak_flops * hardware.utilisation


def step_time(
    model: Transformer,
    layout: Layout,
    precision: Precision,
    hardware: Hardware,
    *,
    optimizer_bytes: int = 12,
) -> StepTime:
    """Seconds per optimizer step on each device. `optimizer_bytes` is K (ZeRO's notation)."""
    tokens = layout.global_batch * model.seq
    flops = tokens * model.train_flops_per_token(layout.recompute)
    compute = flops / layout.devices / flops_rate(hardware)
    bubble = compute * bubble_fraction(
        layout.schedule, layout.pp, layout.microbatches, layout.stages_per_rank
    )
    tp_link, dp_link, pp_link = links(layout, hardware)
    layers_here = math.ceil(model.layers / layout.pp)
    activation = model.seq * layout.micro_batch * model.hidden * precision.activation
    per_layer = 6 if layout.recompute == "full" else 4
    tensor = (
        layers_here * layout.microbatches * per_layer * all_reduce(activation, layout.tp, tp_link)
    )
    boundary = activation / (layout.tp if layout.sequence_parallel else 1)
    pipeline = (
        2 * layout.microbatches * layout.stages_per_rank * send(boundary, pp_link)
        if layout.pp > 1
        else 0.0
    )
    psi = model.stage_params(layout.pp, layout.tp)
    grads, params = psi * precision.grad, psi * precision.param
    if layout.zero == 0:
        data = all_reduce(grads, layout.dp, dp_link)
    elif layout.zero in (1, 2):
        data = reduce_scatter(grads, layout.dp, dp_link) + all_gather(params, layout.dp, dp_link)
    else:
        gathers = 1 if layout.hold_gathered_params else 2
        data = reduce_scatter(grads, layout.dp, dp_link) + gathers * layout.microbatches * (
            all_gather(params, layout.dp, dp_link)
        )
    window = compute * (1.0 if layout.zero >= 3 else 2 / 3) * hardware.overlap
    exposed = max(0.0, data - window)
    updated = psi / (layout.dp if layout.zero >= 1 else 1)
    touched = 2 * optimizer_bytes + precision.grad + 2 * precision.param  # read and write
    optimizer = 0.0 if layout.offload_optimizer else updated * touched / hardware.memory_bandwidth
    return StepTime(compute, bubble, tensor, pipeline, data, exposed, optimizer)


def one_device_step(
    model: Transformer, global_batch: int, precision: Precision, hardware: Hardware, k: int
) -> float:
    """The same step on one device, as if its memory were unlimited (the speedup's baseline)."""
    single = Layout(dp=1, micro_batch=global_batch, microbatches=1)
    return step_time(model, single, precision, hardware, optimizer_bytes=k).total
