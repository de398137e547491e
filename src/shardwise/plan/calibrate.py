"""`shardwise plan --calibrate`: measure this machine so the planner can predict shardwise's own
runs on it. On a CPU a "device" is one core (one rank per core, one thread per rank, as
`shardwise train --nproc <cores>` runs); the profile holds, per core:

- `peak_flops`: the fp32 matrix-multiply peak, measured as every run and `bench/` measure it
  (devices.py);
- `utilisation` and `layer_overhead`: a transformer layer's forward and backward (hidden 512,
  sequence 128: layer norms, attention and GeLU included) timed at micro-batches 1 and 4, and the
  line t = F / (utilisation · peak) + layer_overhead through them (`fit_layer_curve`);
- `memory_bandwidth`: an element-wise a + b → c over 64 MiB arrays (what the optimizer step
  does);

each measured on every core at once (one process per core), as training uses them: cores share
caches and memory bandwidth, so one busy core alone is faster than each of two;
- latency and bandwidth of all-reduce, all-gather and reduce-scatter between two gloo ranks on
  this machine, each collective between bursts of compute as in training, each kind fitted to its
  ring model over messages of 4 KiB to 32 MiB (gloo's kinds differ: its reduce-scatter is slower
  than its all-reduce; NCCL's share one ring, so presets use one α and β);
- `tensor_parallel_efficiency`: the same layer split over the two ranks by the GPT's
  tensor-parallel plan, its time less its four all-reduces, against half the whole layer's
  (both less the layer's overhead, which the planner adds to either whole);
- `runtime_memory`: what those two ranks' work left in a rank's resident set once its tensors
  were freed (glibc told to return freed memory, as the planner counts live tensors): library code
  paged in, kernel and communication workspaces — the part of a training process's memory that
  does not scale with the model;
- `half_codec_rate`, `int8_codec_rate`: fp32 gradient bytes per second through comm/'s bf16 and
  int8 codecs with error feedback, on the LAYER block's tensors, on every core at once (the
  codecs' own collectives on a group of one rank, which copy);
- `powersgd_codec_rate`, `powersgd_matrix_seconds`: comm/powersgd.py's own work at rank
  `POWERSGD_RANK` with error feedback (the factors, their orthonormalisation, the
  approximation, what it lost), timed on two one-layer GPTs of the same tensors, widths 512 and
  64, and split into a cost per gradient byte and one per compressed matrix (the small matrices
  of a small model cost mostly the latter: a few dozen small operations each);
- `memory`: RAM divided by the cores.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.multiprocessing as mp

from shardwise.common.devices import best_seconds, matmul_peak
from shardwise.plan.hardware import POWERSGD_RANK, THIS_MACHINE, Hardware
from shardwise.plan.timing import Link, all_reduce
from shardwise.training.comm.collectives import all_gather_single, reduce_scatter_single

SIZES = [4 << 10, 64 << 10, 512 << 10, 2 << 20, 8 << 20, 32 << 20]
LAYER = {"hidden": 512, "heads": 8, "seq": 128, "batch": 2}
"""The transformer layer measured on a CPU core (fp32); its curve at micro-batches CURVE_BATCHES."""
CURVE_BATCHES = (1, 4)
CPU = torch.device("cpu")


@dataclass(frozen=True)
class LayerShape:
    """A GPT block and its micro-batch: LAYER's unless a job's (calibrate_gpu.py)."""

    hidden: int = LAYER["hidden"]
    heads: int = LAYER["heads"]
    seq: int = LAYER["seq"]
    batch: int = LAYER["batch"]


POWERSGD_WIDTHS = (512, 64, 16)
"""PowerSGD's widths: the first two split its cost per byte from its cost per matrix; at the
last, bytes are few, and its time per matrix bounds that cost where noise made the split's
(a line through two points) zero or less (`powersgd_costs`)."""


def matmul_flops() -> float:
    """A core's fp32 matrix-multiply peak, measured as every run measures it (devices.py)."""
    return matmul_peak(CPU, torch.float32)


def layer_curve(
    shape: LayerShape | None = None,
    batches: tuple[int, ...] = CURVE_BATCHES,
    device: torch.device = CPU,
) -> tuple[float, float]:
    """A GPT block's rate on large layers (FLOP/s, the curve's asymptote) and its overhead
    (seconds per layer and micro-batch), from its times at `batches` (LAYER's on a CPU core in
    fp32; on CUDA under bf16 autocast)."""
    from shardwise.plan.model import Transformer

    shape = shape or LayerShape()
    model = Transformer(layers=1, hidden=shape.hidden, heads=shape.heads, vocab=0, seq=shape.seq)
    per_sample = 3 * model.forward_flops_per_token() * shape.seq
    points = [
        (per_sample * batch, _layer_seconds(tp=False, batch=batch, shape=shape, device=device))
        for batch in batches
    ]
    return curve(points)


def fit_layer_curve(points: list[tuple[float, float]], peak: float) -> tuple[float, float]:
    """(utilisation, layer_overhead) of the line t = F / (utilisation · peak) + overhead through
    (FLOPs, seconds) points of one layer at different micro-batches. Where timing noise would
    make the overhead negative: none, at the largest layer's rate."""
    rate, overhead = curve(points)
    return min(1.0, rate / peak), overhead


def curve(points: list[tuple[float, float]]) -> tuple[float, float]:
    """`fit_layer_curve`'s line as (FLOP/s on large layers, seconds of overhead)."""
    intercept, slope = line(points, floor=1e-30)
    if intercept < 0:
        flops, seconds = max(points)
        return flops / seconds, 0.0
    return 1 / slope, intercept


def _layer_seconds(
    *,
    tp: bool,
    batch: int = LAYER["batch"],
    shape: LayerShape | None = None,
    device: torch.device = CPU,
) -> float:
    """A GPT block's forward and backward at micro-batch `batch` (LAYER's, fp32, by default),
    whole, or split over this process group's two ranks by the GPT's tensor-parallel plan
    (collectives included); in a process group, both ranks at once. On CUDA under bf16
    autocast, as the trainer runs `precision = "bf16"`."""
    from shardwise.models.gpt import build_gpt

    shape = shape or LayerShape()
    model = build_gpt(layers=1, heads=shape.heads, hidden=shape.hidden, seq_len=shape.seq)
    model.to(device)
    if tp:
        from torch.distributed.device_mesh import init_device_mesh

        from shardwise.training.parallel.tensor import apply_tensor_parallel

        apply_tensor_parallel(model, init_device_mesh("cpu", (2,)), None, sequence_parallel=False)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # both ranks measure at once
    block = model.layers["0"]
    x = torch.randn(batch, shape.seq, shape.hidden, device=device, requires_grad=True)
    cuda = device.type == "cuda"

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            y = block(x)
        y.float().sum().backward()

    return best_seconds(step, device=device)


def memory_bandwidth(device: torch.device = CPU, mib: int = 64) -> float:
    """Bytes/s of a + b → c over `mib` MiB fp32 arrays on `device`."""
    n = (mib << 20) // 4
    a, b = torch.randn(n, device=device), torch.randn(n, device=device)
    c = torch.empty(n, device=device)
    return 3 * 4 * n / best_seconds(lambda: torch.add(a, b, out=c), device=device)


def codec_rates() -> tuple[float, float, float, float]:
    """fp32 gradient bytes per second through comm/'s bf16 and int8 codecs as a DDP hook runs
    them (the residual added, the codec, what was lost kept, the mean taken), on the LAYER
    block's tensors; then PowerSGD's bytes per second and seconds per matrix
    (`powersgd_costs`). Their collectives run on a process group of this one rank."""
    import torch.distributed as dist

    from shardwise.models.gpt import build_gpt
    from shardwise.training.comm.base import Sync
    from shardwise.training.comm.compression import Codec, Half, Int8

    block = build_gpt(layers=1, heads=LAYER["heads"], hidden=LAYER["hidden"], seq_len=LAYER["seq"])
    sizes = [p.numel() for p in block.parameters()]
    flat, residual = torch.randn(sum(sizes)), torch.zeros(sum(sizes))
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)  # type: ignore[attr-defined]
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            group = dist.group.WORLD
            assert group is not None
            sync = Sync([], group)
            int8 = Int8(sync)
            int8.sizes = sizes

            def rate(codec: Codec) -> float:
                def once() -> None:
                    bucket = torch.cat([flat]).add_(residual)  # as CompressedSync.reduce
                    total, lost = codec(bucket, group, 1)
                    residual.copy_(lost if lost is not None else total)
                    total.div_(2)

                return 4 * flat.numel() / best_seconds(once)

            half, eight = rate(Half(sync, torch.bfloat16)), rate(int8)
            return half, eight, *powersgd_costs(group)
        finally:
            dist.destroy_process_group()


def powersgd_costs(group: Any) -> tuple[float, float]:
    """comm/powersgd.py's `average` on every gradient of a one-layer GPT at each width of
    POWERSGD_WIDTHS (the same tensors, so the same matrices: m of them), on `group` (one rank):
    t = m·a + bytes / rate, solved for the rate (bytes/s) and a (seconds per matrix) through
    the first two; a is never zero or less (the last width bounds it)."""
    from torch.nn.parallel import DistributedDataParallel

    from shardwise.models.gpt import build_gpt
    from shardwise.training.comm.hierarchical import Topology
    from shardwise.training.comm.powersgd import PowerSGDSync

    points = []
    for width in POWERSGD_WIDTHS:
        block = build_gpt(layers=1, heads=LAYER["heads"], hidden=width, seq_len=LAYER["seq"])
        model = DistributedDataParallel(block, process_group=group)
        topology = Topology(group=group, ranks=1)
        sync = PowerSGDSync(
            [model], group, topology, rank=POWERSGD_RANK, start_step=0, error_feedback=True, seed=0
        )
        try:
            named = [(name, torch.randn_like(p)) for p, name in sync.names.items()]
            seconds = best_seconds(lambda: sync.average(named))  # noqa: B023
        finally:
            sync.close()
        points.append((sum(4 * g.numel() for _, g in named), len(sync.qs), seconds))
    return split_powersgd_costs(points)


def split_powersgd_costs(points: list[tuple[int, int, float]]) -> tuple[float, float]:
    """(bytes per second, seconds per matrix) from (bytes, matrices, seconds) at each of
    POWERSGD_WIDTHS: the line through the first two; where noise makes its time per matrix zero
    or less, the last width's (few bytes: its time is nearly all per-matrix work)."""
    (big, matrices, t_big), (small, _, t_small), (_, _, t_tiny) = points
    per_byte = max(0.0, (t_big - t_small) / (big - small))
    per_matrix = (t_small - small * per_byte) / matrices
    if per_matrix <= 0:
        per_matrix = t_tiny / matrices
    return (1 / per_byte if per_byte > 0 else 1e18), per_matrix


def _per_core_worker(rank: int, barrier: Any, results: Any, codecs: bool) -> None:
    torch.set_num_threads(1)
    barrier.wait()  # every core busy together
    rates = (matmul_flops(), *layer_curve(), memory_bandwidth())
    results[rank] = rates + (codec_rates() if codecs else ())


def per_core_rates(cores: int) -> tuple[float, float, float, float]:
    """Matmul FLOP/s, a transformer layer's FLOP/s on large layers and its overhead (seconds per
    layer and micro-batch), and memory bandwidth per core, with every core measuring at once;
    the mean over cores."""
    peak, layer, overhead, bandwidth = _on_every_core(cores, codecs=False)
    return peak, layer, overhead, bandwidth


def _on_every_core(cores: int, *, codecs: bool) -> tuple[float, ...]:
    """`per_core_rates`, and with `codecs` the codecs' costs after them (`codec_rates`)."""
    with mp.Manager() as manager:
        barrier, results = manager.Barrier(cores), manager.dict()
        mp.start_processes(  # type: ignore[attr-defined,no-untyped-call]
            _per_core_worker, args=(barrier, results, codecs), nprocs=cores, start_method="spawn"
        )
        rates = list(results.values())
    return tuple(statistics.fmean(r[i] for r in rates) for i in range(len(rates[0])))


def _collectives_worker(rank: int, store_path: str, results: dict[Any, float]) -> None:
    """Each collective after a burst of compute, as in training: both ranks multiply matrices for
    about 2 ms, then communicate. Its cost is the median of such iterations less the median of
    compute-only ones, interleaved with them, so it includes what an idle ping-pong misses: the
    ranks arriving at different moments and gloo's threads waiting for a core that is computing.
    Then a transformer layer's forward and backward, whole on each rank and split by tensor
    parallelism; and what all that left in the resident set once its tensors were freed."""
    import gc

    import torch.distributed as dist

    # imported before the baseline, as the trainer's worker has them
    import shardwise.training.parallel.apply
    import shardwise.training.trainer.step  # noqa: F401
    from shardwise.training.trainer.memory import current_bytes

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, 2)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    follows_tensors = _return_freed_memory()
    cpu = torch.device("cpu")
    before = current_bytes(cpu)  # as the trainer's baseline: after joining, before building
    try:
        _collective_seconds(rank, results)
        whole_layer = _layer_seconds(tp=False)
        split_layer = _layer_seconds(tp=True)
        gc.collect()
        if rank == 0:
            results["layer"], results["tp_layer"] = whole_layer, split_layer
            # unknown (0) where freed memory stays in the resident set
            results["runtime"] = max(0, current_bytes(cpu) - before) if follows_tensors else 0
    finally:
        dist.destroy_process_group()


def _collective_seconds(rank: int, results: dict[Any, float]) -> None:
    """Each collective kind at each of SIZES: (kind, size) → seconds, on rank 0."""
    import torch.distributed as dist

    a, b = torch.randn(384, 384), torch.randn(384, 384)

    def iteration(collective: Callable[[], object] | None) -> float:
        dist.barrier()
        began = time.perf_counter()
        for _ in range(10):
            torch.mm(a, b)
        if collective is not None:
            collective()
        return time.perf_counter() - began

    for size in SIZES:
        whole, half = torch.zeros(size // 4), torch.zeros(size // 8)
        kinds: dict[str, Callable[[], object]] = {
            "all_reduce": lambda: dist.all_reduce(whole),  # noqa: B023
            "all_gather": lambda: all_gather_single(whole, half),  # noqa: B023
            "reduce_scatter": lambda: reduce_scatter_single(half, whole),  # noqa: B023
        }
        for kind, collective in kinds.items():
            iteration(collective)  # warm up
            pairs = [(iteration(collective), iteration(None)) for _ in range(15)]
            with_it = statistics.median(t for t, _ in pairs)
            without = statistics.median(t for _, t in pairs)
            if rank == 0:
                results[kind, size] = max(with_it - without, 1e-6)


def _return_freed_memory() -> bool:
    """Have glibc map every allocation of 64 KiB or more on its own and unmap it when freed (as
    MALLOC_MMAP_THRESHOLD_=65536 does), so the resident set follows live tensors; by default it
    keeps freed memory for reuse, which would count as the runtime's. False where the C library
    has no `mallopt` (not glibc)."""
    import ctypes

    m_mmap_threshold = -3
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(m_mmap_threshold, 65536))


def collective_fits(layer_overhead: float = 0.0) -> dict[str, float]:
    """α (seconds) and β (bytes/s) of all-reduce, all-gather and reduce-scatter between two
    ranks, each from a least-squares line through its times over SIZES (a ring of two: t = 2α +
    S/β for all-reduce, α + S/(2β) for the others); and the tensor-parallel layer's compute rate
    relative to the whole layer's (its measured time less its four all-reduces), each less
    `layer_overhead`."""
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(  # type: ignore[attr-defined,no-untyped-call]
            _collectives_worker,
            args=(os.path.join(tmp, "store"), results),
            nprocs=2,
            start_method="spawn",
        )
        measured = dict(results)
    fits = {}
    for kind, steps, volume in (
        ("all_reduce", 2, 1.0),
        ("all_gather", 1, 0.5),
        ("reduce_scatter", 1, 0.5),
    ):
        times = [
            (key[1], t) for key, t in measured.items() if isinstance(key, tuple) and key[0] == kind
        ]
        intercept, slope = line(times)
        fits[kind] = Link(bandwidth=volume / slope, latency=max(intercept, 1e-6) / steps)
    link = fits["all_reduce"]
    activation = LAYER["batch"] * LAYER["seq"] * LAYER["hidden"] * 4
    split_compute = measured["tp_layer"] - 4 * all_reduce(activation, 2, link)
    return {
        "intra_latency": link.latency,
        "intra_bandwidth": link.bandwidth,
        "all_gather_latency": fits["all_gather"].latency,
        "all_gather_bandwidth": fits["all_gather"].bandwidth,
        "reduce_scatter_latency": fits["reduce_scatter"].latency,
        "reduce_scatter_bandwidth": fits["reduce_scatter"].bandwidth,
        "tensor_parallel_efficiency": min(
            1.0,
            (measured["layer"] - layer_overhead) / (2 * max(split_compute - layer_overhead, 1e-9)),
        ),
        "runtime_memory": measured["runtime"],
    }


def line(points: list[tuple[float, float]], floor: float = 1e-12) -> tuple[float, float]:
    """Least-squares intercept and slope (at least `floor`: 1 ps per byte) of t over S."""
    xs, ys = [float(s) for s, _ in points], [t for _, t in points]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mean_x) ** 2 for x in xs
    )
    slope = max(slope, floor)
    return mean_y - slope * mean_x, slope


def ram_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def calibrate(progress: Callable[[str], None] = lambda line: None) -> Hardware:
    cores = len(os.sched_getaffinity(0))
    progress(f"matrix multiplies, a transformer layer and memory bandwidth on {cores} cores…")
    measured = _on_every_core(cores, codecs=True)
    peak, achieved, overhead, bandwidth, half, int8, powersgd, matrix = measured
    progress(
        f"  per core: {peak / 1e9:.1f} GFLOP/s matmul, {achieved / 1e9:.1f} GFLOP/s in a large "
        f"layer + {overhead * 1e3:.2f} ms per layer and micro-batch, "
        f"{bandwidth / 1e9:.1f} GB/s, gradients through the bf16 codec {half / 1e9:.2f} GB/s, "
        f"the int8 codec {int8 / 1e9:.2f} GB/s and PowerSGD r={POWERSGD_RANK} "
        f"{powersgd / 1e9:.2f} GB/s + {matrix * 1e6:.0f} µs per matrix; collectives between "
        "two gloo ranks…"
    )
    fits = collective_fits(overhead)
    progress(
        "  α, β: "
        + "; ".join(
            f"{name} {fits[f'{key}_latency'] * 1e6:.0f} µs, "
            f"{fits[f'{key}_bandwidth'] / 1e9:.2f} GB/s"
            for name, key in (
                ("all-reduce", "intra"),
                ("all-gather", "all_gather"),
                ("reduce-scatter", "reduce_scatter"),
            )
        )
        + f"; a tensor-parallel layer computes at {fits['tensor_parallel_efficiency']:.0%} of "
        f"the rate; runtime memory {fits['runtime_memory'] / 2**20:.0f} MiB"
    )
    return Hardware(
        name=THIS_MACHINE,
        memory=ram_bytes() / cores,
        peak_flops=peak,
        memory_bandwidth=bandwidth,
        inter_bandwidth=fits["intra_bandwidth"],
        inter_latency=fits["intra_latency"],
        gpus_per_node=cores,
        **fits,
        utilisation=min(1.0, achieved / peak),
        layer_overhead=overhead,
        overlap=0.0,
        half_codec_rate=half,
        int8_codec_rate=int8,
        powersgd_codec_rate=powersgd,
        powersgd_matrix_seconds=matrix,
        calibrated=True,
        device="cpu",
    )
