"""The planner on a GPU, against steps measured on one H200 (issue 34; torch 2.11, bf16 autocast,
one process, the built-in GPT on `text`: vocabulary 256, sequence 1024), with the profile
`shardwise plan --calibrate` measured on that GPU (tests/data/h200-calibrated-profile.json, as
../shared/gpu/ holds it): the hand-written loop's eager steps at 86M (micro-batch 8) 35.3 ms and
1.2B (micro-batch 4) 83.9 ms, and shardwise's run at 304M (micro-batch 16) 96.9 ms.

The step is modelled, not fitted: the compute on the profile's curve, the optimizer's bytes at
its bandwidth (fused AdamW: 7 fp32 values per parameter, and clipping's 3), and, where the profile
measured the host's cost per dispatched operator, the longer of the host's dispatching and the
device's work."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from shardwise.plan.hardware import from_mapping
from shardwise.plan.kernels import dispatch_seconds, work
from shardwise.plan.layout import PRECISIONS, Layout
from shardwise.plan.model import Transformer
from shardwise.plan.timing import step_time

PROFILE = Path(__file__).resolve().parents[2] / "data" / "h200-calibrated-profile.json"
AUTOCAST = PRECISIONS["bf16-autocast"]
MEASURED = {  # name: (layers, heads, hidden, micro-batch), seconds per step
    "86M": ((12, 12, 768, 8), 35.3e-3),
    "1.2B": ((24, 16, 2048, 4), 83.9e-3),
    "304M": ((24, 16, 1024, 16), 96.9e-3),
}


def _h200():
    return from_mapping(json.loads(PROFILE.read_text()), name="h200-calibrated")


def _predicted(name: str, hardware) -> float:
    (layers, heads, hidden, micro), _ = MEASURED[name]
    model = Transformer(layers=layers, hidden=hidden, heads=heads, vocab=256, seq=1024)
    return step_time(model, Layout(micro_batch=micro), AUTOCAST, hardware).total


@pytest.mark.parametrize("name", ["1.2B", "304M"])
def test_the_calibrated_h200_predicts_its_device_bound_steps_within_15_percent(name):
    """1.2B and 304M keep the device busy: the curve's compute and the fused optimizer's bytes
    (11.6 ms at 1.2B; the foreach count gave 26) predict them at 1.10x and 0.90x."""
    assert _predicted(name, _h200()) / MEASURED[name][1] == pytest.approx(1, abs=0.15)


@pytest.mark.xfail(
    strict=True,
    reason="the profile was calibrated before `plan --calibrate` measured the host's cost per "
    "dispatched operator; 86M's step is bound by its host (2,050 dispatches): predicted at "
    "0.69x until the GPU is calibrated again",
)
def test_the_calibrated_h200_predicts_its_host_bound_86m_step_within_15_percent():
    assert _predicted("86M", _h200()) / MEASURED["86M"][1] == pytest.approx(1, abs=0.15)


def test_a_measured_dispatch_cost_bounds_a_small_models_step_by_its_host():
    """With the host's cost per dispatch known, a step takes at least its counted dispatches ×
    that cost: the small model's step is its host's, the large one's its device's."""
    h200 = replace(_h200(), dispatch_seconds=15e-6)
    small = Transformer(layers=12, hidden=768, heads=12, vocab=256, seq=1024)
    step = step_time(small, Layout(micro_batch=8), AUTOCAST, h200)
    counted = work(hidden=768, heads=12, ffn=4 * 768, vocab=256, autocast=True)
    assert step.host == pytest.approx(counted.ops(layers=12, microbatches=1) * 15e-6)
    assert step.total == step.host > step.device and step.dominant().startswith("host")
    large = Transformer(layers=24, hidden=2048, heads=16, vocab=256, seq=1024)
    step = step_time(large, Layout(micro_batch=4), AUTOCAST, h200)
    assert step.total == step.device > step.host


@pytest.mark.parametrize("autocast", [False, True])
def test_the_counts_on_fake_tensors_are_those_of_real_ones(autocast):
    """`work` counts on fake tensors (no data, no compute, the same operators), and the optimizer
    step on a narrow model: the dispatches and bytes that real CPU tensors of the planned width
    give, views and in-place operators told apart the same way."""
    from shardwise.plan.kernels import _work

    shape = {"hidden": 64, "heads": 4, "ffn": 256, "vocab": 256, "autocast": autocast}
    assert work(**shape) == _work(**shape, fake=False)


def test_dispatches_are_counted_per_layer_and_bytes_scale_with_the_width():
    """A block's dispatches do not depend on its width; its memory-bound bytes per token do."""
    narrow = work(hidden=64, heads=4, ffn=256, vocab=256, autocast=True)
    wide = work(hidden=128, heads=4, ffn=512, vocab=256, autocast=True)
    assert narrow.layer_ops == wide.layer_ops > 100
    assert narrow.step_ops > 0 and narrow.other_ops > 0
    assert wide.layer_bytes_per_token == pytest.approx(2 * narrow.layer_bytes_per_token, rel=0.01)
    assert (
        narrow.ops(layers=12, microbatches=2)
        == 2 * (12 * narrow.layer_ops + narrow.other_ops) + narrow.step_ops
    )


def test_the_dispatch_cost_is_measured_on_a_device():
    assert 0 < dispatch_seconds(torch.device("cpu"), autocast=False) < math.inf  # measured
