"""Memory per device: model states by ZeRO stage, activations by sequence, micro-batch, tensor /
sequence parallelism and recomputation, and the temporary buffers a layout needs.

Model states follow Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models" (SC'20, arXiv:1910.02054), §5: with Ψ parameters, N_d data-parallel ranks and K
bytes of optimizer state per parameter (K = 12 for mixed-precision Adam), the baseline holds
(2 + 2 + K)Ψ; P_os 2Ψ + 2Ψ + KΨ/N_d; P_os+g 2Ψ + (2 + K)Ψ/N_d; P_os+g+p (2 + 2 + K)Ψ/N_d.

Activations follow Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models" (MLSys'23, arXiv:2205.05198), §4: one layer stores s·b·h·(34 + 5·a·s/h) bytes in 16-bit
with dropout; with tensor parallelism t, s·b·h·(10 + 24/t + 5·a·s/(h·t)); with sequence
parallelism too, s·b·h/t·(34 + 5·a·s/h); selective recomputation drops the 5·a·s/h term (the
attention core is recomputed); full recomputation keeps only each layer's input, 2·s·b·h (÷ t with
sequence parallelism). Those counts are built here from their parts, so the same code also covers
fp32 activations, no dropout, and fused attention that never stores the s × s scores.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.plan.layout import Layout, Precision
from shardwise.plan.model import Transformer

# Per layer, in units of s·b·h values (Korthikanti et al. §4.1, 16-bit bytes ÷ 2):
# kept whole under tensor parallelism: the two layer-norm inputs and the inputs of the QKV and
# first MLP projections; split across t: Q and K, V, the output projection's input, the GeLU's
# input and output (4h each).
_UNSPLIT_VALUES = 4
_SPLIT_VALUES = 12
_DROPOUT_MASKS = 2  # after attention and after the MLP, one byte per value


@dataclass(frozen=True)
class Traced:
    """Bytes one sample's forward pass saves for the backward pass, traced on the meta device
    in fp32 without tensor parallelism (plan/job.py): per transformer layer (their mean), in the
    blocks before the layers (the embedding), and after them (final norm, output layer, loss)."""

    layer: float
    before: float
    after: float


@dataclass(frozen=True)
class Memory:
    """Bytes per device on the most loaded pipeline stage."""

    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    """Temporaries of the forward and backward passes: gathered parameters (ZeRO-3)."""
    scratch: float = 0.0
    """The optimizer step's temporaries (after the backward pass has freed the activations)."""
    runtime: float = 0.0
    """What the training process holds beyond its tensors (`Hardware.runtime_memory`)."""

    @property
    def total(self) -> float:
        """The peak: model states and the runtime, plus the larger of what the forward/backward
        passes and the optimizer step hold on top of them."""
        states = self.params + self.grads + self.optimizer + self.runtime
        return states + max(self.activations + self.buffers, self.scratch)

    def as_dict(self) -> dict[str, float]:
        return {
            "params": self.params,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "buffers": self.buffers,
            "scratch": self.scratch,
            "runtime": self.runtime,
            "total": self.total,
        }


def model_states(
    psi: float, *, dp: int, zero: int, precision: Precision, optimizer: str = "adamw"
) -> tuple[float, float, float]:
    """Parameter, gradient and optimizer bytes per device for Ψ = `psi` parameters (ZeRO §5)."""
    k = precision.optimizer_bytes(optimizer)
    params = precision.param * psi / (dp if zero >= 3 else 1)
    grads = precision.grad * psi / (dp if zero >= 2 else 1)
    states = k * psi / (dp if zero >= 1 else 1)
    return params, grads, states


def layer_activations(
    model: Transformer,
    micro_batch: int,
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    value_bytes: int = 2,
    dropout: bool = True,
    fused_attention: bool = False,
) -> float:
    """Bytes one transformer layer keeps for its backward pass, for one micro-batch."""
    s, b, h, a = model.seq, micro_batch, model.hidden, model.heads
    sbh = s * b * h
    if recompute == "full":
        return sbh * value_bytes / (tp if sequence_parallel else 1)
    masks = _DROPOUT_MASKS if dropout else 0
    unsplit = _UNSPLIT_VALUES * value_bytes + masks
    split = _SPLIT_VALUES * value_bytes
    if sequence_parallel:
        per_layer = (unsplit + split) * sbh / tp
    else:
        per_layer = unsplit * sbh + split * sbh / tp
    if recompute == "selective":
        return per_layer
    if fused_attention:  # the kernel keeps its output (counted above) and a log-sum-exp per row
        return per_layer + 4 * a * s * b / tp
    # softmax output, and with dropout its mask (1 byte) and output
    scores = value_bytes + (1 + value_bytes if dropout else 0)
    return per_layer + scores * a * s * s * b / tp


def in_flight(layout: Layout) -> float:
    """Micro-batches whose activations the first pipeline stage holds at its peak: all of them
    under GPipe, p under 1F1B, p·(1 + (p − 1)/(p·v)) stage-chunks' worth under the interleaved
    schedules (Korthikanti et al. §4.2.3, Narayanan et al. §2.2); one without a pipeline."""
    p, m, v = layout.pp, layout.microbatches, layout.stages_per_rank
    if p == 1:
        return 1
    if layout.schedule == "GPipe":
        return m
    if v > 1:
        return min(p, m) * (1 + (p - 1) / (p * v))
    return min(p, m)


def estimate(
    model: Transformer,
    layout: Layout,
    precision: Precision,
    *,
    optimizer: str = "adamw",
    dropout: bool = True,
    fused_attention: bool = False,
    runtime: float = 0.0,
    traced: Traced | None = None,
) -> Memory:
    """Memory per device on the most loaded stage: the first, which holds the embeddings and the
    most micro-batches in flight (the last stage's output layer is counted there too when
    there is one stage). `runtime` is what the process holds beyond its tensors; `traced`, a
    job's model traced on the meta device, replaces the formulas' activation bytes (which then
    only scale them with tensor and sequence parallelism, recomputation and precision)."""
    layers_here = model.layers_per_stage(layout.pp)
    psi = model.stage_params(layout.pp, layout.tp)
    params, grads, states = model_states(
        psi, dp=layout.dp, zero=layout.zero, precision=precision, optimizer=optimizer
    )
    if layout.unsharded_accumulation and layout.microbatches > 1:
        grads = precision.grad * psi
    if layout.offload_optimizer:
        states = 0.0

    def one_layer(recompute: str = "none", tp: int = layout.tp, value_bytes: int = 4) -> float:
        return layer_activations(
            model,
            layout.micro_batch,
            tp=tp,
            sequence_parallel=layout.sequence_parallel and tp > 1,
            recompute=recompute,
            value_bytes=value_bytes,
            dropout=dropout,
            fused_attention=fused_attention,
        )

    per_layer = one_layer(layout.recompute, value_bytes=precision.activation)
    rebuilt = one_layer(value_bytes=precision.activation)
    if traced is not None:  # the traced bytes, scaled as the formulas scale with the layout
        whole = one_layer(tp=1)
        per_layer *= traced.layer * layout.micro_batch / whole
        rebuilt *= traced.layer * layout.micro_batch / whole
    activations = layers_here * per_layer * in_flight(layout)
    if layout.recompute == "full":  # one layer's activations are rebuilt at a time in backward
        activations += rebuilt
    activations += _outside_layers(model, layout, precision, dropout=dropout, traced=traced)
    scratch = 0.0
    if optimizer in ("adam", "adamw") and not layout.offload_optimizer:
        # PyTorch's default (foreach) Adam computes sqrt(v) into a new parameter-sized fp32
        # tensor every step
        scratch = 4 * psi / (layout.dp if layout.zero >= 1 else 1)
    buffers = _buffers(model, layout, precision)
    return Memory(params, grads, states, activations, buffers, scratch, runtime)


def _outside_layers(
    model: Transformer,
    layout: Layout,
    precision: Precision,
    *,
    dropout: bool,
    traced: Traced | None = None,
) -> float:
    """Korthikanti et al. §4.3: the embedding's dropout mask for each micro-batch in flight
    (s·b·h·p/t), and where the output layer is on the first stage (p = 1) the final norm's input
    and the output projection's input (2·s·b·h/t each in 16-bit) and the fp32 logits the loss
    keeps (4·s·b·v/t)."""
    s, b, h, v = model.seq, layout.micro_batch, model.hidden, model.vocab
    t = layout.tp
    sp = t if layout.sequence_parallel else 1
    embedding = traced.before * b if traced else (s * b * h / sp if dropout else 0.0)
    if layout.pp > 1:
        return embedding * in_flight(layout)
    output = 2 * precision.activation * s * b * h / sp + 4 * s * b * v / t
    if traced is not None:  # scaled as the formula scales from fp32 on one device
        output *= traced.after * b / (2 * 4 * s * b * h + 4 * s * b * v)
    return embedding * in_flight(layout) + output


def _buffers(model: Transformer, layout: Layout, precision: Precision) -> float:
    """Temporaries at the peak: ZeRO-3 (FSDP2) gathers a layer's parameters into one flat buffer
    and copies them out into the layer's own; prefetching the next layer while one is in use
    holds three layers whole (the one in use, the next one's buffer and its copy). Holding them
    from forward to backward, every layer is whole (next to the shards, which stay allocated),
    plus a buffer while the next lands. (DDP with `gradient_as_bucket_view`, as shardwise runs
    it, keeps gradients inside its all-reduce buckets: no copy.)"""
    if layout.zero < 3 or layout.dp == 1:
        return 0.0
    layers_here = model.layers_per_stage(layout.pp)
    layer = model.layer_params / layout.tp * precision.param
    if layout.hold_gathered_params:
        return (layers_here + 1) * layer
    return 3 * layer
