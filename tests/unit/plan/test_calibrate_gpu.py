"""calibrate_gpu.py's measurements are device-agnostic code: here they run on CPU devices (fp32,
gloo) — what differs on CUDA is the device, bf16 autocast, NCCL and the synchronisation before
reading the clock (`best_seconds`), which no test here can run."""

from __future__ import annotations

import pytest
import torch

from shardwise.common.devices import matmul_peak
from shardwise.plan.calibrate import LayerShape, layer_curve
from shardwise.plan.calibrate_gpu import (
    ALL_REDUCE_SIZES,
    all_reduce_link,
    curve_batches,
    memory_bandwidth,
    preset_for,
)

CPU = torch.device("cpu")
SMALL = LayerShape(hidden=128, heads=4, seq=64, batch=4)


def test_rates_and_the_layer_curve_on_a_device():
    peak = matmul_peak(CPU, torch.float32)
    rate, overhead = layer_curve(SMALL, curve_batches(SMALL.batch), CPU)
    assert peak > 1e8 and rate > 0 and overhead >= 0
    assert memory_bandwidth(CPU, mib=64) > 1e8


@pytest.mark.parametrize(("batch", "pair"), [(1, (1, 2)), (2, (1, 2)), (4, (1, 4)), (16, (4, 16))])
def test_the_curve_is_fitted_between_a_quarter_of_the_micro_batch_and_it(batch, pair):
    assert curve_batches(batch) == pair


def test_an_all_reduce_link_is_fitted_across_processes():
    latency, bandwidth = all_reduce_link(2, "cpu", ALL_REDUCE_SIZES[:3])
    assert 0 < latency < 0.01 and 1e7 < bandwidth < 1e12


@pytest.mark.parametrize(
    ("name", "preset"),
    [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("NVIDIA A100 80GB PCIe", "a100-80gb"),
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_a_lone_gpu_takes_its_presets_link(name, preset):
    found = preset_for(name)
    assert (found.name if found else None) == preset
