"""Enumerate layouts, drop those that cannot exist or do not fit (with the reason), rank the rest
by step time, and explain the winner."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from shardwise.plan.comm_modes import Comparison, Mode, Tensors, compare
from shardwise.plan.hardware import Hardware
from shardwise.plan.layout import RECOMPUTE, Layout, Precision, Recompute
from shardwise.plan.memory_model import Memory, Traced, estimate
from shardwise.plan.model import Transformer, divisors
from shardwise.plan.network import Network
from shardwise.plan.timing import StepTime, achieved_utilisation, one_device_step, step_time

MAX_LAYOUTS = 20_000
"""The most layouts one search weighs (a few seconds): real models on real clusters have a few
thousand; more means degrees with thousands of divisors, and the user fixes some of them."""

HEADROOM = 0.9
"""A layout fits when its estimate is at most 90% of device memory: the rest is left for the
allocator's fragmentation, the CUDA context and communication libraries' buffers."""


@dataclass(frozen=True)
class Constraints:
    """What the user fixed; None lets the search choose."""

    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    zero: int | None = None
    micro_batch: int | None = None
    recompute: Recompute | None = None
    offload: bool = False


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    memory: Memory
    time: StepTime
    fits: bool
    reason: str = ""


@dataclass
class Plan:
    model: Transformer
    hardware: Hardware
    precision: Precision
    optimizer: str
    devices: int
    global_batch: int
    tokens: float | None
    dropout: bool = True
    fused_attention: bool = True
    traced: Traced | None = None
    """A job's model traced on the meta device (activation bytes), when planning a job file."""
    ranked: list[Candidate] = field(default_factory=list)
    dropped: list[Candidate] = field(default_factory=list)
    one_device_step: float = 0.0
    network: Network | None = None
    """`--link`: the network between nodes (already in `hardware`); the communication modes
    are compared on it."""
    tensors: Tensors | None = None
    """A job's model's parameter shapes (None: the transformer's standard ones)."""
    job_mode: Mode | None = None
    """A job's own communication mode, compared with the others."""

    @property
    def best(self) -> Candidate | None:
        return self.ranked[0] if self.ranked else None

    def steps(self) -> float | None:
        if self.tokens is None:
            return None
        return self.tokens / (self.global_batch * self.model.seq)

    def run_seconds(self, candidate: Candidate) -> float | None:
        steps = self.steps()
        return None if steps is None else steps * candidate.time.total

    def speedup(self, candidate: Candidate) -> float:
        return self.one_device_step / candidate.time.total

    def comm_modes(self, candidate: Candidate) -> Comparison:
        """Every data-parallel communication mode on `candidate`'s layout (comm_modes.py)."""
        return compare(
            self.model, candidate.layout, self.precision, self.hardware, candidate.time,
            tensors=self.tensors, job=self.job_mode,
        )  # fmt: skip

    def evaluate(self, layout: Layout) -> Candidate:
        """Memory and step time of `layout` for this plan's model, hardware and precision; if
        it does not fit, why."""
        memory = estimate(
            self.model,
            layout,
            self.precision,
            optimizer=self.optimizer,
            dropout=self.dropout,
            fused_attention=self.fused_attention,
            runtime=self.hardware.runtime_memory,
            traced=self.traced,
        )
        time = step_time(
            self.model, layout, self.precision, self.hardware, optimizer=self.optimizer
        )
        budget = self.hardware.memory * HEADROOM
        if memory.total <= budget:
            return Candidate(layout, memory, time, fits=True)
        reason = (
            f"needs {memory.total / 2**30:.2f} GiB per device, more than the "
            f"{budget / 2**30:.2f} usable ({HEADROOM:.0%} of {gib(self.hardware.memory)}); "
            f"largest part: {_biggest(memory)}"
        )
        return Candidate(layout, memory, time, fits=False, reason=reason)


class NoLayout(ValueError):
    """No layout can exist for these devices and this model (not: none fits)."""


def layouts(
    model: Transformer, devices: int, global_batch: int, gpus_per_node: int, fixed: Constraints
) -> list[Layout]:
    """Every layout that can exist: tp divides the heads and stays within a node, pp is at most
    the layer count, dp·tp·pp = devices, the batch splits into whole micro-batches; sequence
    parallelism whenever tp > 1 (it only saves memory); 1F1B, and the interleaved schedule with
    two stages per rank where the layers allow. The search chooses micro-batches up to 64; a
    fixed one may be larger. NoLayout once there are more than MAX_LAYOUTS."""
    found: list[Layout] = []
    for tp, pp, dp, micro in _shapes(model, devices, global_batch, gpus_per_node, fixed):
        for zero in range(4) if dp > 1 else (0,):
            if fixed.zero is not None and zero != fixed.zero:
                continue
            for recompute in RECOMPUTE:
                if fixed.recompute and recompute != fixed.recompute:
                    continue
                base = Layout(
                    dp=dp,
                    tp=tp,
                    pp=pp,
                    zero=zero,
                    micro_batch=micro,
                    microbatches=global_batch // dp // micro,
                    recompute=recompute,
                    sequence_parallel=tp > 1,
                    offload_optimizer=fixed.offload and zero >= 1,
                )
                found.append(base)
                if pp > 1 and model.layers % (2 * pp) == 0:
                    found.append(replace(base, schedule="Interleaved1F1B", stages_per_rank=2))
                if len(found) > MAX_LAYOUTS:
                    raise NoLayout(_too_many(devices, global_batch))
    return found


def _shapes(
    model: Transformer, devices: int, global_batch: int, gpus_per_node: int, fixed: Constraints
) -> Iterator[tuple[int, int, int, int]]:
    """(tp, pp, dp, micro-batch) of every layout that can exist."""
    for tp in divisors(devices):
        if tp > gpus_per_node or model.heads % tp or (fixed.tp and tp != fixed.tp):
            continue
        for pp in divisors(devices // tp):
            if pp > model.layers or (fixed.pp and pp != fixed.pp):
                continue
            dp = devices // (tp * pp)
            if (fixed.dp and dp != fixed.dp) or global_batch % dp:
                continue
            per_rank = global_batch // dp
            for micro in divisors(per_rank):
                if micro > (fixed.micro_batch or 64) or (
                    fixed.micro_batch and micro != fixed.micro_batch
                ):
                    continue
                if pp > 1 and per_rank // micro < pp:
                    continue  # the pipeline would never fill
                yield tp, pp, dp, micro


def _too_many(devices: int, global_batch: int) -> str:
    return (
        f"{devices} devices and a global batch of {global_batch} make more than "
        f"{MAX_LAYOUTS:,} layouts to weigh; fix part of the layout (--tp, --pp, --dp, "
        "--micro-batch, --zero or --recompute), or plan for a device count and batch with "
        "fewer divisors"
    )


def search(
    model: Transformer,
    hardware: Hardware,
    precision: Precision,
    *,
    devices: int,
    global_batch: int,
    optimizer: str = "adamw",
    tokens: float | None = None,
    fixed: Constraints = Constraints(),
    dropout: bool = True,
    fused_attention: bool = True,
    traced: Traced | None = None,
) -> Plan:
    candidates = layouts(model, devices, global_batch, hardware.gpus_per_node, fixed)
    if not candidates:
        raise NoLayout(_why_none(model, devices, global_batch, hardware, fixed))
    plan = Plan(
        model, hardware, precision, optimizer, devices, global_batch, tokens,
        dropout=dropout, fused_attention=fused_attention, traced=traced,
    )  # fmt: skip
    plan.one_device_step = one_device_step(model, global_batch, precision, hardware, optimizer)
    for layout in candidates:
        candidate = plan.evaluate(layout)
        (plan.ranked if candidate.fits else plan.dropped).append(candidate)
    # times equal to 0.1% rank by memory: the layout that leaves more room first
    fastest = min((c.time.total for c in plan.ranked), default=1.0)
    plan.ranked.sort(key=lambda c: (round(c.time.total / fastest, 3), c.memory.total))
    plan.dropped.sort(key=lambda c: c.memory.total)
    return plan


def _biggest(memory: Memory) -> str:
    parts = {k: v for k, v in memory.as_dict().items() if k != "total"}
    name, value = max(parts.items(), key=lambda kv: kv[1])
    return f"{name} {gib(value)}"


def _why_none(
    model: Transformer, devices: int, global_batch: int, hardware: Hardware, fixed: Constraints
) -> str:
    if fixed.tp and (model.heads % fixed.tp or fixed.tp > hardware.gpus_per_node):
        return (
            f"--tp {fixed.tp}: tensor parallelism must divide the {model.heads} heads and stay "
            f"within a node ({hardware.gpus_per_node} devices); try --tp "
            f"{max(d for d in divisors(model.heads) if d <= hardware.gpus_per_node)}"
        )
    if fixed.pp and fixed.pp > model.layers:
        return f"--pp {fixed.pp}: more stages than the model's {model.layers} layers"
    product = (fixed.dp or 1) * (fixed.tp or 1) * (fixed.pp or 1)
    if devices % product:
        return (
            f"dp × tp × pp must divide the {devices} devices; the degrees given multiply to "
            f"{product}"
        )
    fitting = [d for d in divisors(devices) if global_batch % d == 0]
    shares = sorted({global_batch // d for d in fitting})
    if fixed.micro_batch and all(s % fixed.micro_batch for s in shares):
        return (
            f"--micro-batch {fixed.micro_batch} divides no data-parallel rank's share of the "
            f"global batch of {global_batch} (global batch / dp: {_few(shares)}); choose a "
            "micro-batch that divides one"
        )
    given = _given(fixed)
    if given:
        return (
            f"no layout of {devices} devices with a global batch of {global_batch} has {given}: "
            "tp must divide the heads and stay within a node, a pipeline needs at least as many "
            "micro-batches per step as stages, ZeRO needs dp > 1; leave one of them to the search"
        )
    return (
        f"no layout of {devices} devices splits a global batch of {global_batch} into whole "
        f"micro-batches (data-parallel degrees that divide it: {fitting}); choose a global batch "
        f"that is a multiple of {devices}"
    )


def _given(fixed: Constraints) -> str:
    """The constraints the user fixed, as the flags that fixed them."""
    flags = {
        "--dp": fixed.dp,
        "--tp": fixed.tp,
        "--pp": fixed.pp,
        "--zero": fixed.zero,
        "--micro-batch": fixed.micro_batch,
        "--recompute": fixed.recompute,
    }
    given = [f"{flag} {value}" for flag, value in flags.items() if value is not None]
    return " ".join(given + (["--offload"] if fixed.offload else []))


def _few(values: list[int]) -> str:
    return ", ".join(map(str, values[:8])) + (", …" if len(values) > 8 else "")


def explain(plan: Plan) -> list[str]:
    """Why the winner wins, what dominates its step, and what would change the answer."""
    best = plan.best
    if best is None:
        smallest = plan.dropped[0]
        return [
            f"nothing fits: the smallest layout, {smallest.layout.name()}, {smallest.reason}",
            _nearest_fix(plan, smallest),
        ]
    terms = best.time.terms()
    total = best.time.total
    share = ", ".join(f"{k} {v / total:.0%}" for k, v in terms.items() if v / total >= 0.01)
    lines = [
        f"fastest: {best.layout.name()} — {seconds(total)} per step ({share}); "
        f"{gib(best.memory.total)} of {gib(plan.hardware.memory)} per device",
    ]
    dominant = best.time.dominant()
    lines.append(f"dominant term: {dominant}; {_lever(dominant, best, plan)}")
    faster = [c for c in plan.dropped if c.time.total < total]
    if faster:
        f = min(faster, key=lambda c: c.time.total)
        lines.append(
            f"would change it: {f.layout.name()} is {total / f.time.total:.2f}x faster but "
            f"needs {gib(f.memory.total)} per device (more device memory, or less per device)"
        )
    if len(plan.ranked) > 1:
        second = plan.ranked[1]
        slower = second.time.total / total - 1
        if slower < 0.001:
            why = f"as fast, but needs {gib(second.memory.total)} per device"
        else:
            worse = max(second.time.terms(), key=lambda k: second.time.terms()[k] - terms[k])
            why = f"{slower:.1%} slower, mostly in {worse}"
        lines.append(f"runner-up: {second.layout.name()}, {why}")
    return lines


def _lever(dominant: str, best: Candidate, plan: Plan) -> str:
    if dominant == "compute":
        share = achieved_utilisation(plan.model, best.layout, plan.hardware)
        return (
            f"the step is compute-bound at {share:.0%} of peak: faster "
            "devices or more of them (with a larger batch) shorten it; parallelism choices "
            "matter little"
        )
    if dominant == "pipeline bubble":
        return "more micro-batches (a larger global batch) or an interleaved schedule shrink it"
    if dominant == "tensor-parallel comm":
        return "a smaller tp, or faster links inside the node, shorten it"
    if dominant == "pipeline comm":
        return "fewer stages, or stages whose ranks share a node (faster links), shorten it"
    if dominant.startswith("data-parallel"):
        return "a larger batch per step or a faster network amortise it; ZeRO-3 adds 50% to it"
    return "it is memory-bound: it shrinks with sharding (ZeRO-1+) across more devices"


def _nearest_fix(plan: Plan, smallest: Candidate) -> str:
    need = smallest.memory.total / HEADROOM
    factor = need / plan.hardware.memory
    return (
        f"nearest that would work: about {_about(factor)}x the devices with the same sharding "
        f"(ZeRO-3 divides model states by the data-parallel degree), devices with "
        f"{gib(need)} or more, full recomputation, or a smaller micro-batch or sequence"
    )


def gib(value: float) -> str:
    if value >= 2**40:
        return f"{value / 2**40:.1f} TiB"
    if value >= 2**30:
        return f"{value / 2**30:.1f} GiB"
    return f"{value / 2**20:.0f} MiB"


def seconds(value: float) -> str:
    if value >= 86_400:
        return f"{_about(value / 86_400)} days"
    if value >= 3_600:
        return f"{value / 3_600:.1f} h"
    if value >= 1:
        return f"{value:.2f} s"
    return f"{value * 1e3:.1f} ms"


def _about(value: float) -> str:
    """One decimal, or three significant digits once that would print more than a few digits
    (a device of 1e-300 TFLOP/s takes 1e+283 days, not a number 284 digits long)."""
    return f"{value:.1f}" if value < 1e6 else f"{value:.3g}"
