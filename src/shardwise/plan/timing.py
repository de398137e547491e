"""Time per step and per run: compute on a curve by layer size (each layer's forward and backward
at `utilisation` of the peak, plus `layer_overhead` per micro-batch: small layers reach less of
the peak than large ones), each collective with a latency–bandwidth (α–β) model on the link it
crosses, and the pipeline bubble of the schedule.

What overlaps with what (stated, not measured):
- tensor-parallel collectives sit between dependent matrix multiplies: never overlapped. Per layer
  and micro-batch, 2 all-reduces in forward and 2 in backward (2 more with full recomputation,
  which replays the forward); with sequence parallelism an all-gather and a reduce-scatter in place
  of each. The embedding adds one all-reduce in forward (and an all-gather in backward with
  sequence parallelism), the output layer a gather of the logits in forward and an all-reduce
  (reduce-scatter) of its input's gradient in backward — as shardwise's GPT plan issues them;
- pipeline sends (one activation forward, one gradient back per micro-batch and stage boundary):
  not overlapped (an upper bound; they are small);
- data-parallel gradient sync (all-reduce, or reduce-scatter + all-gather under ZeRO) overlaps
  with the backward pass, ZeRO-3's parameter all-gathers with forward and backward, up to the
  hardware's `overlap` fraction of that compute; the rest is exposed;
- the optimizer step is memory-bound and runs after everything else: the fused AdamW and SGD
  kernels shardwise uses read and write each parameter's fp32 values once (`FUSED_PASSES`);
  where a layout mixes sharded and plain tensors (tensor parallelism) it falls back to the
  multi-tensor ("foreach") implementations, which pass over them once per operation
  (`OPTIMIZER_PASSES`); gradient clipping reads the gradients twice and writes them once.

On a GPU the host dispatches every operator before the device can run it, and runs ahead of it:
a step takes the longer of the two. Where the hardware says what a dispatch costs the host
(`dispatch_seconds`, which `shardwise plan --calibrate` measures on a GPU), the step's dispatches
are counted on the built-in GPT at the model's width (kernels.py: its layers' forward and
backward per micro-batch, the embedding, head and loss, clipping and the optimizer) and the step
is the longer of that host time and the device's work (the compute, its bubble, the exposed
communication and the optimizer). A small model's step is then bound by its host, as measured.

Ranks are placed tensor-parallel innermost, then data-parallel, then pipeline (Megatron-LM's
order): a tensor-parallel group stays inside a node when tp ≤ GPUs per node; data-parallel and
pipeline traffic crosses nodes once the groups inside them outgrow a node. A collective that
crosses nodes runs at the slower link's rate and pays the slower link's latency at every step of
its ring (network.py's `--link` sets that link).
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
    gather: Link | None = None
    """All-gathers' own α and β, where measured; None: the same as all-reduce's."""
    scatter: Link | None = None
    """Reduce-scatters' own, likewise."""
    tree: bool = True
    """Whether all-reduce may run as a tree where that is faster (NCCL picks one); gloo's
    all-reduce, which calibrated (CPU) profiles measure, is always a ring."""


def all_reduce(size: float, n: int, link: Link) -> float:
    """Ring: 2(n−1) steps of size/n each; a tree (log-depth, whole-size transfers) wins for
    small messages. The faster of the two, as NCCL picks (the ring alone where `link.tree` is
    false)."""
    if n <= 1 or size <= 0:
        return 0.0
    ring = 2 * (n - 1) * link.latency + 2 * (n - 1) / n * size / link.bandwidth
    if not link.tree:
        return ring
    tree = 2 * math.ceil(math.log2(n)) * link.latency + 2 * size / link.bandwidth
    return min(ring, tree)


def _ring_pass(size: float, n: int, link: Link) -> float:
    """(n−1) steps of size/n: a ring all-gather or reduce-scatter of a `size`-byte whole."""
    if n <= 1 or size <= 0:
        return 0.0
    return (n - 1) * link.latency + (n - 1) / n * size / link.bandwidth


def all_gather(size: float, n: int, link: Link) -> float:
    return _ring_pass(size, n, link.gather or link)


def reduce_scatter(size: float, n: int, link: Link) -> float:
    return _ring_pass(size, n, link.scatter or link)


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
    host: float = 0.0
    """Seconds the host takes to dispatch the step's operators (GPUs with a measured
    `dispatch_seconds`; 0 otherwise): the step takes at least this long."""

    @property
    def device(self) -> float:
        return (
            self.compute + self.bubble + self.tensor_parallel + self.pipeline + self.exposed
        ) + self.optimizer

    @property
    def total(self) -> float:
        return max(self.device, self.host)

    def terms(self) -> dict[str, float]:
        found = {
            "compute": self.compute,
            "pipeline bubble": self.bubble,
            "tensor-parallel comm": self.tensor_parallel,
            "pipeline comm": self.pipeline,
            "data-parallel comm (exposed)": self.exposed,
            "optimizer step": self.optimizer,
        }
        if self.host > self.device:
            found["host dispatching the operators"] = self.host
        return found

    def dominant(self) -> str:
        return max(self.terms().items(), key=lambda kv: kv[1])[0]


def links(layout: Layout, hardware: Hardware) -> tuple[Link, Link, Link]:
    """The links tensor-, data- and pipeline-parallel traffic crosses."""
    node = hardware.gpus_per_node
    intra, inter = node_links(hardware)
    tp = intra if layout.tp <= node else inter
    dp = intra if layout.tp * layout.dp <= node else inter
    pp = intra if layout.devices <= node else inter
    return tp, dp, pp


def node_links(hardware: Hardware) -> tuple[Link, Link]:
    """The link inside a node and the one across nodes. Measured all-gather and reduce-scatter
    rates (gloo's, on one machine) hold across nodes too unless the network is slower than the
    machine's own all-reduce, where the slower of the two rates and latencies applies."""
    tree = not hardware.calibrated
    gather = _measured(hardware.all_gather_bandwidth, hardware.all_gather_latency)
    scatter = _measured(hardware.reduce_scatter_bandwidth, hardware.reduce_scatter_latency)
    intra = Link(hardware.intra_bandwidth, hardware.intra_latency, gather, scatter, tree)
    bandwidth, latency = hardware.inter_bandwidth, hardware.inter_latency
    if bandwidth < hardware.intra_bandwidth or latency > hardware.intra_latency:
        gather, scatter = _slower(gather, bandwidth, latency), _slower(scatter, bandwidth, latency)
    return intra, Link(bandwidth, latency, gather, scatter, tree)


def _measured(bandwidth: float | None, latency: float | None) -> Link | None:
    return None if bandwidth is None or latency is None else Link(bandwidth, latency)


def _slower(measured: Link | None, bandwidth: float, latency: float) -> Link | None:
    if measured is None:
        return None
    return Link(min(measured.bandwidth, bandwidth), max(measured.latency, latency))


def flops_rate(hardware: Hardware) -> float:
    """The rate large matrix multiplies reach: the curve's asymptote."""
    return hardware.peak_flops * hardware.utilisation


def compute_time(model: Transformer, layout: Layout, hardware: Hardware) -> float:
    """Seconds of forward and backward compute per step on one device: its share of the FLOPs
    at `flops_rate`, plus `layer_overhead` for every layer of the busiest pipeline stage and
    every micro-batch (full recomputation replays each forward: a third more)."""
    tokens = layout.global_batch * model.seq
    flops = tokens * model.train_flops_per_token(layout.recompute)
    compute = flops / layout.devices / flops_rate(hardware)
    if layout.tp > 1:
        compute /= hardware.tensor_parallel_efficiency
    passes = layout.microbatches * model.layers_per_stage(layout.pp)
    replay = 4 / 3 if layout.recompute == "full" else 1.0
    return compute + passes * replay * hardware.layer_overhead


def achieved_utilisation(model: Transformer, layout: Layout, hardware: Hardware) -> float:
    """The share of the peak the step's compute reaches on the curve (recomputation's extra
    FLOPs not counted as useful)."""
    flops = layout.global_batch * model.seq * model.train_flops_per_token()
    return flops / layout.devices / hardware.peak_flops / compute_time(model, layout, hardware)


def step_time(
    model: Transformer,
    layout: Layout,
    precision: Precision,
    hardware: Hardware,
    *,
    optimizer: str = "adamw",
) -> StepTime:
    """Seconds per optimizer step on each device."""
    compute = compute_time(model, layout, hardware)
    bubble = compute * bubble_fraction(
        layout.schedule, layout.pp, layout.microbatches, layout.stages_per_rank
    )
    tp_link, dp_link, pp_link = links(layout, hardware)
    activation = model.seq * layout.micro_batch * model.hidden * precision.activation
    tensor = layout.microbatches * tensor_parallel_comm(model, layout, activation, tp_link)
    boundary = activation / (layout.tp if layout.sequence_parallel else 1)
    pipeline = (
        2 * layout.microbatches * layout.stages_per_rank * send(boundary, pp_link)
        if layout.pp > 1
        else 0.0
    )
    psi = model.stage_params(layout.pp, layout.tp)
    data = data_parallel_comm(psi, layout, precision, dp_link)
    exposed = max(0.0, data - overlap_window(compute, layout, hardware))
    updated = psi / (layout.dp if layout.zero >= 1 else 1)
    passes = (FUSED_PASSES if fused(optimizer, layout) else OPTIMIZER_PASSES)[optimizer]
    touched = 4 * passes + 3 * precision.grad  # + clipping
    optimizer_s = 0.0 if layout.offload_optimizer else updated * touched / hardware.memory_bandwidth
    host = host_time(model, layout, precision, hardware)
    return StepTime(compute, bubble, tensor, pipeline, data, exposed, optimizer_s, host)


def fused(optimizer: str, layout: Layout) -> bool:
    """Whether shardwise's optimizer is the fused kernel in this layout (trainer/optim.py): one
    kernel takes all-plain or all-sharded parameters, not tensor parallelism's mix; fused SGD
    takes no sharded ones."""
    return layout.tp == 1 and (optimizer.startswith("adam") or layout.zero == 0)


def host_time(
    model: Transformer, layout: Layout, precision: Precision, hardware: Hardware
) -> float:
    """Seconds the host takes to dispatch a step's operators on the busiest stage (see the module
    docstring); 0 where the hardware has no `dispatch_seconds` or is a CPU (whose host is its
    device: the compute already counts it)."""
    if hardware.dispatch_seconds is None or hardware.device == "cpu":
        return 0.0
    from shardwise.plan.kernels import work

    counted = work(
        hidden=model.hidden,
        heads=model.heads,
        ffn=model.ffn_size,
        vocab=max(model.vocab, 2),
        autocast=precision.name.endswith("-autocast"),
    )
    passes = 4 / 3 if layout.recompute == "full" else 1.0
    layers = model.layers_per_stage(layout.pp) * passes
    ops = counted.ops(layers=round(layers), microbatches=layout.microbatches)
    return ops * hardware.dispatch_seconds


def data_parallel_comm(
    psi: float,
    layout: Layout,
    precision: Precision,
    link: Link,
    *,
    reduce_bytes: float | None = None,
) -> float:
    """Seconds of every-step data-parallel traffic for `psi` parameters per rank: DDP's
    all-reduce of the gradients, or ZeRO's reduce-scatter and all-gathers. `reduce_bytes`: the
    bytes per gradient value the reduction sends, where not the gradients' own (FSDP2's
    `reduce_dtype`)."""
    grads = psi * (precision.grad if reduce_bytes is None else reduce_bytes)
    params = psi * precision.param
    if layout.zero == 0:
        return all_reduce(grads, layout.dp, link)
    if layout.zero in (1, 2):
        return reduce_scatter(grads, layout.dp, link) + all_gather(params, layout.dp, link)
    return reduce_scatter(grads, layout.dp, link) + gathers_per_step(layout) * all_gather(
        params, layout.dp, link
    )


def gathers_per_step(layout: Layout) -> int:
    """ZeRO-3's all-gathers of the parameters per step: one per micro-batch for forward, and
    another for backward unless the gathered parameters are held."""
    return (1 if layout.hold_gathered_params else 2) * layout.microbatches


def overlap_window(compute: float, layout: Layout, hardware: Hardware) -> float:
    """How much data-parallel traffic can hide behind compute: the backward pass (ZeRO-3: the
    forward pass too), times the hardware's `overlap`."""
    return compute * (1.0 if layout.zero >= 3 else 2 / 3) * hardware.overlap


FUSED_PASSES = {"adamw": 7, "adam": 7, "sgd-momentum": 5, "sgd": 3}
"""fp32 values read or written per parameter by the fused kernels (torch/optim, `fused=True`):
AdamW reads the parameter, its gradient and both moments and writes the parameter and moments;
SGD with momentum reads the parameter, gradient and momentum and writes two; plain SGD reads two
and writes one."""
OPTIMIZER_PASSES = {"adamw": 20, "adam": 20, "sgd-momentum": 8, "sgd": 3}
"""fp32 values read or written per parameter by PyTorch's multi-tensor optimizers (torch/optim):
AdamW's decay, lerp, mul, addcmul, sqrt, div, add and addcdiv read 12 and write 8; SGD with
momentum's mul, add and update read 5 and write 3; plain SGD's update reads 2 and writes 1."""


def tensor_parallel_comm(
    model: Transformer, layout: Layout, activation: float, link: Link
) -> float:
    """Tensor-parallel communication for one micro-batch on the busiest pipeline stage (see the
    module docstring for what is counted); `activation` is one layer's input, s·b·h values."""
    t = layout.tp
    if t <= 1:
        return 0.0
    passes = 6 if layout.recompute == "full" else 4  # per layer, in units of all-reduces
    ar = all_reduce(activation, t, link)
    if layout.sequence_parallel:  # each all-reduce becomes an all-gather and a reduce-scatter
        ag, rs = all_gather(activation, t, link), reduce_scatter(activation, t, link)
        per_layer, embedding, head_input = passes * (ag + rs), ar + ag, ag + rs
    else:
        per_layer, embedding, head_input = passes * ar, ar, ar
    logits = all_gather(activation / model.hidden * model.vocab, t, link)
    layers_here = model.layers_per_stage(layout.pp)
    last = head_input + logits if layout.pp == 1 else 0.0  # the first stage is the busiest
    return layers_here * per_layer + embedding + last


def one_device_step(
    model: Transformer, global_batch: int, precision: Precision, hardware: Hardware, optimizer: str
) -> float:
    """The same step on one device, as if its memory were unlimited (the speedup's baseline)."""
    single = Layout(dp=1, micro_batch=global_batch, microbatches=1)
    return step_time(model, single, precision, hardware, optimizer=optimizer).total
