"""The data-parallel communication modes of `comm/` compared on a layout and a network
(`shardwise plan --link`): the bytes each sends per step, what crosses between nodes, and the
step time each gives. Pure arithmetic; nothing here runs a collective or imports `comm/`
(which needs a process group). The formulas, and what is and is not modelled: docs/planner.md,
"How each mode is costed".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from shardwise.plan.hardware import POWERSGD_RANK, Hardware
from shardwise.plan.layout import Layout, Precision
from shardwise.plan.model import Transformer
from shardwise.plan.timing import (
    Link,
    StepTime,
    all_gather,
    all_reduce,
    data_parallel_comm,
    flops_rate,
    gathers_per_step,
    links,
    node_links,
    overlap_window,
)

Compression = Literal["none", "bf16", "fp16", "int8", "powersgd"]
SyncKind = Literal["every_step", "local_sgd", "diloco", "async"]
FIRST_BUCKET, BUCKET = 2**20, 25 * 2**20
"""DDP's bucket sizes (torch's defaults, which shardwise keeps), in bytes of gradients."""


@dataclass(frozen=True)
class Mode:
    """One way to synchronise data-parallel ranks, as a job file's keys choose it."""

    compression: Compression = "none"
    """`parallel.grad_compression`, or for diloco `train.outer_compression`."""
    hierarchical: bool = False
    sync: SyncKind = "every_step"
    sync_every: int = 16
    powersgd_rank: int = 2
    max_staleness: int = 4

    def name(self) -> str:
        """What tells it apart: e.g. `ddp`, `hierarchical + powersgd r=4`, `diloco H=16 + int8`,
        `async k=4`."""
        if self.sync == "async":
            return f"async k={self.max_staleness}"
        if self.sync != "every_step":
            rest = [] if self.compression == "none" else [self.compression]
            return " + ".join([f"{self.sync} H={self.sync_every}", *rest])
        parts = ["hierarchical"] if self.hierarchical else []
        if self.compression == "powersgd":
            parts.append(f"powersgd r={self.powersgd_rank}")
        elif self.compression != "none":
            parts.append(self.compression)
        return " + ".join(parts) or "ddp"


DDP = Mode()
CODEC_PASSES: dict[str, float] = {"none": 0, "bf16": 16, "fp16": 16, "int8": 50, "powersgd": 15}
"""Bytes read or written per byte of gradients by each codec's element-wise work, counted from
comm/compression.py and comm/powersgd.py with error feedback on (adding the residual, casting or
quantising and back, keeping what was lost, averaging), at memory bandwidth: where the hardware
has no measured codec rate (`Hardware.half_codec_rate`, `int8_codec_rate`; on a CPU core the
casts and rounding run 4–7 times slower than these passes would). PowerSGD's three matrix
multiplies add 6·r FLOPs per matrix element at the hardware's rate."""
SYNC_PASSES = {"local_sgd": 6, "diloco": 20}
"""Likewise per byte of fp32 parameters at each synchronisation: local SGD flattens, averages
and copies back; DiLoCo also forms the change, steps its outer Nesterov SGD and copies."""


@dataclass(frozen=True)
class Placement:
    """Where a layout's data-parallel group sits: `ranks` of them, `per_node` on each node
    (tensor-parallel ranks innermost, as timing.py places them)."""

    ranks: int
    per_node: int

    @property
    def nodes(self) -> int:
        return math.ceil(self.ranks / self.per_node)


def placement(layout: Layout, hardware: Hardware) -> Placement:
    per_node = max(1, min(layout.dp, hardware.gpus_per_node // layout.tp))
    return Placement(layout.dp, per_node)


@dataclass(frozen=True)
class Tensors:
    """The model's trainable tensors, by shape (for PowerSGD's factors and int8's scales)."""

    shapes: tuple[tuple[int, ...], ...]

    @property
    def elements(self) -> int:
        return max(1, sum(math.prod(s) for s in self.shapes))

    def powersgd(self, rank: int) -> tuple[int, int, int]:
        """Numbers in P, in Q, and sent uncompressed."""
        p = q = plain = 0
        for shape in self.shapes:
            factors = _factors(shape, rank)
            if factors is None:
                plain += math.prod(shape)
            else:
                r, n, m = factors
                p, q = p + r * n, q + r * m
        return p, q, plain

    def compressed(self, rank: int) -> int:
        """How many matrices PowerSGD sends as factors."""
        return sum(_factors(shape, rank) is not None for shape in self.shapes)

    def buckets(self, value_bytes: int) -> list[Tensors]:
        """DDP's buckets: tensors from the last back, a bucket closed once it holds its size
        (FIRST_BUCKET, then BUCKET each)."""
        found: list[Tensors] = []
        current: list[tuple[int, ...]] = []
        size = 0
        for shape in reversed(self.shapes):
            current.append(shape)
            size += math.prod(shape) * value_bytes
            if size >= (BUCKET if found else FIRST_BUCKET):
                found.append(Tensors(tuple(current)))
                current, size = [], 0
        if current or not found:
            found.append(Tensors(tuple(current)))
        return found

    def int8(self, ranks: int) -> tuple[int, int]:
        """Int8's all-to-all payload over `ranks`: each tensor padded to `ranks` equal chunks,
        one byte a value; and one fp32 scale per chunk of each tensor."""
        values = sum(ranks * math.ceil(math.prod(s) / ranks) for s in self.shapes)
        return values, 4 * ranks * len(self.shapes)


def _factors(shape: tuple[int, ...], rank: int) -> tuple[int, int, int] | None:
    """PowerSGD's rank, rows and columns for a tensor it compresses (comm/powersgd.py's
    `_compressible`: a matrix whose factors are no larger than it); None for one sent whole."""
    if len(shape) < 2:
        return None
    n, m = shape[0], math.prod(shape[1:])
    r = min(rank, n, m)
    return (r, n, m) if r * (n + m) <= n * m else None


def transformer_tensors(model: Transformer) -> Tensors:
    """The built-in GPT's tensors (models/gpt.py): per layer q, k, v and the projection (h × h)
    and the MLP (f × h, h × f) with biases, two layer norms; token and position embeddings, the
    final norm, and the output layer when untied."""
    h, f = model.hidden, model.ffn_size
    layer = [(h, h)] * 4 + [(h,)] * 4 + [(f, h), (f,), (h, f), (h,)] + [(h,)] * 4
    rest = [(model.vocab, h), (model.seq, h), (h,), (h,)]
    rest += [] if model.tied_embeddings else [(model.vocab, h)]
    return Tensors(tuple(layer * model.layers + rest))


@dataclass(frozen=True)
class Group:
    """Ranks that run one collective together, and the link its slowest step crosses."""

    ranks: int
    per_node: int
    link: Link

    @property
    def crosses(self) -> bool:
        return self.ranks > self.per_node


@dataclass
class Traffic:
    """One step of a mode: bytes rank 0 sends, bytes each node sends to the others, seconds."""

    sent: float = 0.0
    across: float = 0.0
    seconds: float = 0.0

    def ring(self, nbytes: float, group: Group, steps: int) -> None:
        """A ring collective of `steps` × (n−1) steps, each rank sending `nbytes`/n a step."""
        n = group.ranks
        if n <= 1 or nbytes <= 0:
            return
        volume = steps * (n - 1) / n * nbytes
        self.sent += volume
        self.across += volume if group.crosses else 0.0

    def all_reduce(self, nbytes: float, group: Group) -> None:
        self.ring(nbytes, group, 2)
        self.seconds += all_reduce(nbytes, group.ranks, group.link)

    def all_gather(self, nbytes: float, group: Group) -> None:
        self.ring(nbytes, group, 1)
        self.seconds += all_gather(nbytes, group.ranks, group.link)

    def all_to_all(self, nbytes: float, group: Group) -> None:
        """Each rank sends `nbytes`/n to every other; a node's k ranks send k(n−k)/n·`nbytes`
        across its link together."""
        n, k = group.ranks, group.per_node
        if n <= 1 or nbytes <= 0:
            return
        self.sent += (n - 1) / n * nbytes
        self.across += k * (n - k) / n * nbytes
        busiest = max(n - 1, k * (n - k)) / n * nbytes
        self.seconds += (n - 1) * group.link.latency + busiest / group.link.bandwidth

    def inside_node(self, nbytes: float, ranks: int, link: Link, *, leader_sends: bool) -> None:
        """A reduce to the leader or a broadcast from it, pipelined along the node's ranks."""
        if ranks <= 1 or nbytes <= 0:
            return
        self.sent += nbytes if leader_sends else 0.0
        self.seconds += (ranks - 1) * link.latency + nbytes / link.bandwidth

    def scaled(self, factor: float) -> Traffic:
        return Traffic(self.sent * factor, self.across * factor, self.seconds * factor)


@dataclass(frozen=True)
class ModeCost:
    mode: Mode
    sent: float = 0.0
    """Bytes rank 0 sends per step (comm/'s `comm/bytes_per_step`)."""
    across: float = 0.0
    """Bytes each node sends to the other nodes per step, each direction of its link."""
    comm: float = 0.0
    """Seconds of the mode's collectives per step (amortised over H for local SGD, DiLoCo)."""
    exposed: float = 0.0
    """Seconds the step waits for them and for the codec's work."""
    step: float = 0.0
    why_not: str = ""
    """Why the mode does not apply to this layout ("" where it does)."""

    @property
    def applies(self) -> bool:
        return not self.why_not


@dataclass(frozen=True)
class Comparison:
    placement: Placement
    costs: list[ModeCost]

    @property
    def baseline(self) -> ModeCost:
        return self.costs[0]

    def fastest(self) -> ModeCost | None:
        return min((c for c in self.costs if c.applies), key=lambda c: c.step, default=None)


def modes(
    rank: int = 2, every: int = 16, job: Mode | None = None, staleness: int = 4
) -> list[Mode]:
    """ddp first, then every mode of comm/ worth comparing (fp16 sends what bf16 does: listed
    only as a job's own), the job's own mode last if it is none of them."""
    found = [
        DDP,
        Mode("bf16"),
        Mode("int8"),
        Mode("powersgd", powersgd_rank=rank),
        Mode(hierarchical=True),
        Mode("bf16", hierarchical=True),
        Mode("int8", hierarchical=True),
        Mode("powersgd", hierarchical=True, powersgd_rank=rank),
        Mode(sync="local_sgd", sync_every=every),
        Mode(sync="diloco", sync_every=every),
        Mode("bf16", sync="diloco", sync_every=every),
        Mode("int8", sync="diloco", sync_every=every),
        Mode(sync="async", max_staleness=staleness),
    ]
    if job is not None and job.name() not in {m.name() for m in found}:
        found.append(job)
    return found


def job_mode(mode: Mode, *, auto: bool, layout: Layout, hardware: Hardware) -> Mode:
    """A job's mode with `parallel.hierarchical = "auto"` resolved as comm/hierarchical.py does:
    on where DDP's ranks span several nodes and some node holds more than one of them."""
    where = placement(layout, hardware)
    ddp = layout.zero == 0 and layout.tp == 1 and layout.pp == 1 and mode.sync == "every_step"
    if auto and ddp and where.nodes > 1 and where.per_node > 1:
        return replace(mode, hierarchical=True)
    return mode


def compare(
    model: Transformer,
    layout: Layout,
    precision: Precision,
    hardware: Hardware,
    time: StepTime,
    *,
    tensors: Tensors | None = None,
    job: Mode | None = None,
) -> Comparison:
    """Every mode of `modes` on `layout` (whose step time is `time`), ddp first."""
    rank = job.powersgd_rank if job else 2
    every = job.sync_every if job else 16
    staleness = job.max_staleness if job else 4
    where = placement(layout, hardware)
    shapes = tensors or transformer_tensors(model)
    costs = [
        _cost(mode, model, layout, precision, hardware, time, where, shapes)
        for mode in modes(rank, every, job, staleness)
    ]
    return Comparison(where, costs)


def _cost(
    mode: Mode,
    model: Transformer,
    layout: Layout,
    precision: Precision,
    hardware: Hardware,
    time: StepTime,
    where: Placement,
    tensors: Tensors,
) -> ModeCost:
    why_not = _why_not(mode, layout, where)
    if why_not:
        return ModeCost(mode, why_not=why_not)
    psi = model.stage_params(layout.pp, layout.tp)
    rest = time.total - time.exposed
    dp_link = links(layout, hardware)[1]
    intra, inter = node_links(hardware)
    flat = Group(where.ranks, where.per_node, dp_link)
    wrapped = layout.zero > 0 or layout.tp > 1 or layout.pp > 1
    if mode.sync == "async":
        return _served(mode, psi, rest, where, intra, inter)
    if mode.sync != "every_step":
        traffic, passes = _occasional(mode, psi, flat, hardware, tensors)
        exposed = traffic.seconds + passes
    else:  # every step: the collectives overlap backward, the codec's work does not
        hidden = overlap_window(time.compute, layout, hardware)
        if wrapped or mode.name() == "ddp":  # DDP's own all-reduce, or FSDP2's reduction
            reduce_bytes = min(precision.grad, 2) if mode.compression in ("bf16", "fp16") else None
            traffic, work = _wrapper(psi, layout, precision, flat, reduce_bytes), 0.0
        else:  # DDP's comm hook, on shardwise's communication thread
            grads, leaders = psi * precision.grad, Group(where.nodes, 1, inter)
            traffic = _hooked(mode, grads, precision.grad, flat, leaders, intra, where, tensors)
            work = _codec_seconds(mode, psi, precision.grad, hardware, tensors)
        exposed = max(0.0, traffic.seconds - hidden) + work
    return ModeCost(
        mode,
        sent=traffic.sent,
        across=traffic.across,
        comm=traffic.seconds,
        exposed=exposed,
        step=rest + exposed,
    )


def _why_not(mode: Mode, layout: Layout, where: Placement) -> str:
    ddp = layout.zero == 0 and layout.tp == 1 and layout.pp == 1
    if layout.dp <= 1:
        return "one data-parallel rank: nothing to synchronise"
    if mode.sync == "async" and not ddp:
        return "a parameter server of whole replicas: plain data parallelism only"
    if mode.sync != "every_step" and layout.zero > 0:
        return "keeps a whole replica on every rank: ZeRO 0 only"
    if (
        mode.sync == "every_step"
        and not ddp
        and (mode.hierarchical or mode.compression in ("int8", "powersgd"))
    ):
        return "a DDP comm hook: this layout reduces with FSDP2 (bf16 or fp16 its one lever)"
    if mode.hierarchical and where.nodes == 1:
        return "the data-parallel ranks share one node"
    if mode.hierarchical and where.per_node == 1:
        return "one data-parallel rank per node: the flat ring already sends one copy across"
    return ""


def _wrapper(
    psi: float, layout: Layout, precision: Precision, flat: Group, reduce_bytes: float | None
) -> Traffic:
    """The layout's own every-step reduction, as timing.data_parallel_comm times it."""
    grads = psi * (precision.grad if reduce_bytes is None else reduce_bytes)
    seconds = data_parallel_comm(psi, layout, precision, flat.link, reduce_bytes=reduce_bytes)
    traffic = Traffic(seconds=seconds)
    if layout.zero == 0:
        traffic.ring(grads, flat, 2)
        return traffic
    gathers = 1 if layout.zero < 3 else gathers_per_step(layout)
    traffic.ring(grads, flat, 1)
    traffic.ring(gathers * psi * precision.param, flat, 1)
    return traffic


def _hooked(
    mode: Mode,
    grads: float,
    value_bytes: int,
    flat: Group,
    leaders: Group,
    intra: Link,
    where: Placement,
    tensors: Tensors,
) -> Traffic:
    """DDP's comm hook, bucket by bucket: each sum (PowerSGD: P, Q and the rest; otherwise the
    gradients) by the mode's codec, across all ranks or through the nodes' leaders."""
    scale = grads / tensors.elements  # bytes per element of the model's own tensors
    traffic = Traffic()
    for bucket in tensors.buckets(value_bytes):
        if mode.compression == "powersgd":
            numbers = bucket.powersgd(mode.powersgd_rank)
            sums = [(n * scale, "none") for n in numbers if n]
        else:
            sums = [(bucket.elements * scale, str(mode.compression))]
        for nbytes, codec in sums:
            if not mode.hierarchical:
                _codec(traffic, codec, nbytes, value_bytes, flat, bucket)
                continue
            traffic.inside_node(nbytes, where.per_node, intra, leader_sends=False)
            _codec(traffic, codec, nbytes, value_bytes, leaders, bucket)
            traffic.inside_node(nbytes, where.per_node, intra, leader_sends=True)
    return traffic


def _codec(
    traffic: Traffic, codec: str, nbytes: float, value_bytes: int, group: Group, tensors: Tensors
) -> None:
    """One sum of `nbytes` (values of `value_bytes` each) over `group`, as comm/compression.py's
    codecs send it."""
    if codec in ("bf16", "fp16"):
        traffic.all_reduce(nbytes * min(value_bytes, 2) / value_bytes, group)
    elif codec == "int8":
        values, scales = tensors.int8(group.ranks)
        scale = nbytes / value_bytes / tensors.elements
        for payload in (values * scale, scales):  # the 8-bit values, then their scales
            traffic.all_to_all(payload, group)
            traffic.all_gather(payload, group)
    else:
        traffic.all_reduce(nbytes, group)


def _codec_seconds(
    mode: Mode, psi: float, value_bytes: int, hardware: Hardware, tensors: Tensors
) -> float:
    """The codec's own work on `psi` gradient values: at the hardware's measured codec rate
    where calibrated, else its element-wise passes at memory bandwidth; and PowerSGD's matrix
    products."""
    nbytes = psi * value_bytes
    half, int8 = hardware.half_codec_rate, hardware.int8_codec_rate
    rate = {"bf16": half, "fp16": half, "int8": int8}.get(mode.compression)
    if rate is not None:
        return nbytes / rate
    if mode.compression != "powersgd":
        return CODEC_PASSES[mode.compression] * nbytes / hardware.memory_bandwidth
    r = mode.powersgd_rank
    matrices = (tensors.elements - tensors.powersgd(r)[2]) * psi / tensors.elements
    per_byte, per_matrix = hardware.powersgd_codec_rate, hardware.powersgd_matrix_seconds
    if per_byte is None or per_matrix is None:
        seconds = CODEC_PASSES["powersgd"] * nbytes / hardware.memory_bandwidth
        return seconds + 6 * r * matrices / flops_rate(hardware)
    # measured at POWERSGD_RANK; another rank's factors cost its FLOPs more or less
    seconds = nbytes / per_byte + tensors.compressed(r) * per_matrix
    return max(0.0, seconds + 6 * (r - POWERSGD_RANK) * matrices / flops_rate(hardware))


def _occasional(
    mode: Mode, psi: float, flat: Group, hardware: Hardware, tensors: Tensors
) -> tuple[Traffic, float]:
    """Local SGD's or DiLoCo's all-reduce of the fp32 parameters every H steps, per step; and
    the seconds of their element-wise work per step."""
    params = psi * 4
    traffic = Traffic()
    _codec(traffic, str(mode.compression), params, 4, flat, tensors)
    work = SYNC_PASSES[mode.sync] * params / hardware.memory_bandwidth
    work += _codec_seconds(mode, psi, 4, hardware, tensors)  # DiLoCo's outer compression
    return traffic.scaled(1 / mode.sync_every), work / mode.sync_every


def _served(
    mode: Mode, psi: float, rest: float, where: Placement, intra: Link, inter: Link
) -> ModeCost:
    """Async: a worker's compute, push and pull in turn; rank 0's server receiving the pushes
    one at a time and sending the pulls one at a time; the slower paces the step."""
    params = psi * 4  # fp32 gradients pushed, fp32 parameters pulled
    n, k = where.ranks, min(where.per_node, where.ranks)
    remote, local = n - k, k - 1
    far = inter.latency + params / inter.bandwidth
    near = intra.latency + params / intra.bandwidth
    server = remote * far + local * near  # each way
    slowest = far if remote else near
    # with no staleness every pull waits for the round's last push
    step = rest + server + slowest if mode.max_staleness == 0 else max(rest + 2 * slowest, server)
    return ModeCost(
        mode,
        sent=(n - 1) * params,
        across=remote * params,
        comm=server,
        exposed=step - rest,
        step=step,
    )
