"""The built-in ResNet (torch's BatchNorm, residual blocks, no torchvision) on real images (the
digits upsampled to 3×32×32): a pipeline over its residual blocks trains it as one process does,
the BatchNorm running statistics included; ResNet-50 has the published size.

Tolerance: different summation orders, fp32; the pipeline's micro-batches are the one process's
accumulation micro-batches, so each BatchNorm sees the same batches. Adam spreads the last bits
(as in test_compile): on an AVX-512 CPU the losses agree to 2e-7 up to step 3 and to 2.3e-5 at
step 4, the parameters and statistics to 3.8e-5 (a running variance), so 1e-4 for both."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_same_training, digits_job, outcome, train_in_workers
from shardwise.models.vision import build_resnet

pytestmark = pytest.mark.slow
STEPS = 4
RESNET = {
    "model": {"name": "resnet", "args": {"depth": 18, "width": 8}},
    "data": {"name": "digits", "args": {"image_size": 32, "channels": 3}},
    "train": {"steps": STEPS, "global_batch": 8, "micro_batch": 2, "lr": 3e-3},
    "eval": {"max_samples": 16},
}


def job(run_dir, parallel):
    return digits_job(run_dir, **RESNET, parallel=parallel).model_dump(mode="json")


def test_a_pipeline_over_residual_blocks_matches_one_process(tmp_path):
    failures = train_in_workers(1, [("one", job(tmp_path / "one", {}), None)])
    failures |= train_in_workers(
        2, [("pp", job(tmp_path / "pp", {"pp": 2, "pipeline_schedule": "GPipe"}), None)]
    )
    runs = {"root": tmp_path, "failures": failures}
    one = outcome(runs, "one", STEPS)
    assert any("running_mean" in name for name in one[1])  # buffers are compared too
    assert_same_training(
        outcome(runs, "pp", STEPS), one, range(1, STEPS + 1), loss_rtol=1e-4, param_atol=1e-4
    )


@pytest.mark.parametrize(("depth", "millions"), [(18, 11.17), (50, 23.52)])
def test_the_networks_have_their_published_sizes(depth, millions):
    with torch.device("meta"):
        model = build_resnet(depth=depth)
    assert sum(p.numel() for p in model.parameters()) / 1e6 == pytest.approx(millions, abs=0.01)
    assert list(model._modules)[:2] == ["stem", "stage1_0"] and "head" in model._modules
