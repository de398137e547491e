"""`shardwise plan --calibrate`: measure this machine so the planner can predict shardwise's own
runs on it. On a CPU a "device" is one core (one rank per core, one thread per rank, as
`shardwise train --nproc <cores>` runs); the profile holds, per core:

- `peak_flops`: the best fp32 matrix-multiply rate over square sizes 256–1024;
- `utilisation`: the share of that rate a transformer layer's forward and backward reaches
  (hidden 512, sequence 128, micro-batch 2: layer norms, attention and GeLU included);
- `memory_bandwidth`: an element-wise a + b → c over 64 MiB arrays (what the optimizer step
  does);

each measured on every core at once (one process per core), as training uses them: cores share
caches and memory bandwidth, so one busy core alone is faster than each of two;
- all-reduce latency and bandwidth from two gloo ranks on this machine, each collective
  between bursts of compute as in training, fitted to t = 2α + S/β (a ring of two) over
  messages of 4 KiB to 32 MiB;
- `memory`: RAM divided by the cores.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from shardwise.plan.hardware import THIS_MACHINE, Hardware

SIZES = [4 << 10, 64 << 10, 1 << 20, 8 << 20, 32 << 20]


def _best_seconds(fn: Callable[[], object], repeats: int = 5, inner: int = 3) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - began) / inner)
    return min(times)


def matmul_flops() -> float:
    best = 0.0
    for n in (256, 512, 1024):
        a, b = torch.randn(n, n), torch.randn(n, n)
        best = max(best, 2 * n**3 / _best_seconds(lambda: torch.mm(a, b)))  # noqa: B023
    return best


def layer_flops() -> float:
    from shardwise.models.gpt import build_gpt
    from shardwise.plan.model import Transformer

    hidden, seq, batch = 512, 128, 2
    block = build_gpt(layers=1, heads=8, hidden=hidden, seq_len=seq).layers["0"]
    x = torch.randn(batch, seq, hidden, requires_grad=True)

    def step() -> None:
        block(x).sum().backward()

    shape = Transformer(layers=1, hidden=hidden, heads=8, vocab=0, seq=seq)
    flops = 3 * shape.forward_flops_per_token() * batch * seq
    return flops / _best_seconds(step)


def memory_bandwidth() -> float:
    n = 16 << 20  # 64 MiB of fp32
    a, b, c = torch.randn(n), torch.randn(n), torch.empty(n)
    return 3 * 4 * n / _best_seconds(lambda: torch.add(a, b, out=c))


def _per_core_worker(rank: int, barrier: Any, results: Any) -> None:
    torch.set_num_threads(1)
    barrier.wait()  # every core busy together
    results[rank] = (matmul_flops(), layer_flops(), memory_bandwidth())


def per_core_rates(cores: int) -> tuple[float, float, float]:
    """Matmul FLOP/s, transformer-layer FLOP/s and memory bandwidth per core, with every core
    measuring at once; the mean over cores."""
    with mp.Manager() as manager:
        barrier, results = manager.Barrier(cores), manager.dict()
        mp.start_processes(  # type: ignore[attr-defined,no-untyped-call]
            _per_core_worker, args=(barrier, results), nprocs=cores, start_method="spawn"
        )
        rates = list(results.values())
    peak, layer, bandwidth = (statistics.fmean(r[i] for r in rates) for i in range(3))
    return peak, layer, bandwidth


def _all_reduce_worker(rank: int, store_path: str, results: dict[int, float]) -> None:
    """Each collective between two bursts of compute, as in training: both ranks multiply
    matrices for about 2 ms, then all-reduce; the collective's cost is the iteration's time less
    the compute's, so it includes what an idle ping-pong misses — the ranks arriving at different
    moments and gloo's threads waiting for a core that is computing."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, 2)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    a, b = torch.randn(384, 384), torch.randn(384, 384)

    def compute() -> None:
        for _ in range(10):
            torch.mm(a, b)

    try:
        alone = _best_seconds(compute, repeats=10, inner=1)
        for size in SIZES:
            t = torch.zeros(size // 4)
            times = []
            dist.barrier()
            for _ in range(14):
                began = time.perf_counter()
                compute()
                dist.all_reduce(t)
                times.append(time.perf_counter() - began - alone)
            if rank == 0:
                results[size] = max(statistics.median(times[2:]), 1e-6)
    finally:
        dist.destroy_process_group()


def all_reduce_fit() -> tuple[float, float]:
    """(α seconds, β bytes/s) from a least-squares fit of t = 2α + S/β over SIZES."""
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(  # type: ignore[attr-defined,no-untyped-call]
            _all_reduce_worker,
            args=(os.path.join(tmp, "store"), results),
            nprocs=2,
            start_method="spawn",
        )
        points = sorted(results.items())
    xs, ys = [float(s) for s, _ in points], [t for _, t in points]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mean_x) ** 2 for x in xs
    )
    intercept = max(mean_y - slope * mean_x, 1e-6)
    return intercept / 2, 1 / slope


def ram_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def calibrate(progress: Callable[[str], None] = lambda line: None) -> Hardware:
    cores = len(os.sched_getaffinity(0))
    progress(f"matrix multiplies, a transformer layer and memory bandwidth on {cores} cores…")
    peak, achieved, bandwidth = per_core_rates(cores)
    progress(
        f"  per core: {peak / 1e9:.1f} GFLOP/s matmul, {achieved / 1e9:.1f} GFLOP/s in a layer, "
        f"{bandwidth / 1e9:.1f} GB/s; all-reduce between two gloo ranks…"
    )
    latency, link = all_reduce_fit()
    progress(f"  α {latency * 1e6:.0f} µs, β {link / 1e9:.2f} GB/s")
    return Hardware(
        name=THIS_MACHINE,
        memory=ram_bytes() / cores,
        peak_flops=peak,
        memory_bandwidth=bandwidth,
        intra_bandwidth=link,
        intra_latency=latency,
        inter_bandwidth=link,
        inter_latency=latency,
        gpus_per_node=cores,
        utilisation=min(1.0, achieved / peak),
        overlap=0.0,
        calibrated=True,
    )
