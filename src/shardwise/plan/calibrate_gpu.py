"""`shardwise plan --calibrate` on a machine with CUDA GPUs (calibrate.py measures a CPU's cores):
the profile the planner predicts shardwise's runs on this machine from, per GPU:

- `peak_flops`: the bf16 matrix-multiply peak, measured as every run and `bench/` measure it
  (devices.py: squares of 4096 and 8192, the best of short bursts);
- `utilisation` and `layer_overhead`: one block of the built-in GPT at the job's width, heads and
  sequence, forward and backward under bf16 autocast, at a quarter of the job's micro-batch and at
  the job's, and the line t = F / (utilisation · peak) + overhead through them: the curve by layer
  size that makes small models and small micro-batches reach less of the peak. Without a job
  file: width 2048, 16 heads, sequence 2048, micro-batch 4;
- `memory_bandwidth`: a + b → c over 256 MiB arrays;
- `dispatch_seconds`: the host's time per operator dispatched, on a GPT block too small to keep
  the GPU busy (plan/kernels.py): what bounds a small model's step;
- `memory`: the device's total memory;
- with two or more GPUs, α and β of NCCL's all-reduce among all of them, fitted to the ring
  model over messages of 1 MiB to 256 MiB (NCCL's all-gather and reduce-scatter run on the same
  ring: the planner uses the same link). With one GPU there is no link to measure: the links are
  those of the preset the device's name matches, or PCIe Gen4 x16's 32 GB/s, and the progress
  says which.

All-reduce is then the ring fitted here at every size (a calibrated profile's links carry no
tree algorithm: the fit already holds what NCCL picked on this node). Links across nodes are set
equal to those measured inside the node (one machine is all this
sees): give `--link` or `--inter-gbs` when planning for several nodes. A CPU profile on a GPU
machine: `CUDA_VISIBLE_DEVICES= shardwise plan --calibrate`.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from shardwise.common.devices import best_seconds, device_name, matmul_peak
from shardwise.plan.calibrate import LayerShape, layer_curve, line, memory_bandwidth
from shardwise.plan.hardware import PRESETS, THIS_MACHINE, Hardware
from shardwise.plan.kernels import dispatch_seconds

DEFAULT_SHAPE = LayerShape(hidden=2048, heads=16, seq=2048, batch=4)
ALL_REDUCE_SIZES = [1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]
PCIE_GEN4 = 32e9
"""Bytes/s per direction of a PCIe Gen4 x16 link: a lone GPU's link when its name matches no
preset."""


def curve_batches(batch: int) -> tuple[int, int]:
    """Two micro-batches to fit the curve through: a quarter of the job's and the job's (1 and 2
    for a micro-batch of 1)."""
    low = max(1, batch // 4)
    return low, batch if batch > low else 2 * low


def all_reduce_link(
    world: int, device_type: str, sizes: list[int] = ALL_REDUCE_SIZES
) -> tuple[float, float]:
    """(α seconds, β bytes/s) of all-reduce among `world` devices, one process each (NCCL on
    CUDA, gloo on CPU), from a least-squares line through its times over `sizes` (bytes): the
    ring's t = 2(n−1)α + 2(n−1)/n · S/β."""
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(  # type: ignore[attr-defined,no-untyped-call]
            _all_reduce_worker,
            args=(world, device_type, sizes, os.path.join(tmp, "store"), results),
            nprocs=world,
            start_method="spawn",
        )
        times = sorted(results.items())
    intercept, slope = line(times)
    steps = 2 * (world - 1)
    return max(intercept, 1e-6) / steps, steps / world / slope


def _all_reduce_worker(
    rank: int,
    world: int,
    device_type: str,
    sizes: list[int],
    store_path: str,
    results: dict[int, float],
) -> None:
    import torch.distributed as dist

    cuda = device_type == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    store = dist.FileStore(store_path, world)  # type: ignore[attr-defined]
    bound: dict[str, Any] = {"device_id": device} if cuda else {}
    dist.init_process_group(
        "nccl" if cuda else "gloo", store=store, rank=rank, world_size=world, **bound
    )
    try:
        for size in sizes:
            tensor = torch.zeros(size // 4, device=device)
            dist.barrier()
            seconds = best_seconds(lambda: dist.all_reduce(tensor), device=device)  # noqa: B023
            if rank == 0:
                results[size] = seconds
    finally:
        dist.destroy_process_group()


def preset_for(device_name: str) -> Hardware | None:
    """The preset the device's name names ("NVIDIA H100 80GB HBM3" → h100), or None."""
    name = device_name.lower()
    if "a100" in name:
        return PRESETS["a100-40gb" if "40gb" in name else "a100-80gb"]
    return next((PRESETS[key] for key in ("h200", "h100", "l40s") if key in name), None)


def calibrate_gpu(
    shape: LayerShape | None = None, progress: Callable[[str], None] = lambda line: None
) -> Hardware:
    """Measure this machine's GPUs (see the module docstring) into a profile."""
    shape = shape or DEFAULT_SHAPE
    device, gpus = torch.device("cuda", 0), torch.cuda.device_count()
    name = torch.cuda.get_device_name(device)
    progress(
        f"{gpus} × {name}: bf16 matrix multiplies, a GPT block (width {shape.hidden}, "
        f"sequence {shape.seq}) at micro-batches {curve_batches(shape.batch)}, memory bandwidth…"
    )
    peak = matmul_peak(device, torch.bfloat16)
    rate, overhead = layer_curve(shape, curve_batches(shape.batch), device)
    bandwidth = memory_bandwidth(device, mib=256)
    dispatch = dispatch_seconds(device)
    progress(
        f"  {peak / 1e12:.0f} TFLOP/s matmul, {rate / 1e12:.0f} TFLOP/s in large layers + "
        f"{overhead * 1e3:.2f} ms per layer and micro-batch, {bandwidth / 1e9:.0f} GB/s, "
        f"{dispatch * 1e6:.1f} µs of host time per operator dispatched"
    )
    if gpus >= 2:
        progress(f"all-reduce among the {gpus} GPUs (NCCL)…")
        latency, link = all_reduce_link(gpus, "cuda")
        progress(f"  α {latency * 1e6:.0f} µs, β {link / 1e9:.0f} GB/s")
    else:
        like = preset_for(name)
        latency = like.intra_latency if like else 5e-6
        link = like.intra_bandwidth if like else PCIE_GEN4
        progress(
            f"  one GPU, no link to measure: {link / 1e9:.0f} GB/s and {latency * 1e6:.0f} µs "
            + (f"from the {like.name} preset" if like else "(PCIe Gen4 x16)")
        )
    return Hardware(
        name=THIS_MACHINE,
        memory=torch.cuda.get_device_properties(device).total_memory,
        peak_flops=peak,
        memory_bandwidth=bandwidth,
        intra_bandwidth=link,
        intra_latency=latency,
        inter_bandwidth=link,
        inter_latency=latency,
        gpus_per_node=gpus,
        utilisation=min(1.0, rate / peak),
        layer_overhead=overhead,
        overlap=1.0,
        dispatch_seconds=dispatch,
        calibrated=True,
        device=device_name(device),
    )
