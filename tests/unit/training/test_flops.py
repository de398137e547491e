"""FLOPs are counted on the meta device for any model, and agree with the closed form where one
exists; the peak is measured, not looked up."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from shardwise.models.gpt import build_gpt
from shardwise.training.job_names import LOSSES
from shardwise.training.trainer.flops import (
    Peak,
    Utilisation,
    count_flops,
    count_real,
    for_run,
    measure_peak,
    meta_batch,
    transformer_flops,
)

CROSS_ENTROPY = LOSSES["cross_entropy"]


@pytest.mark.parametrize(("layers", "hidden", "seq"), [(2, 64, 32), (4, 256, 128)])
def test_the_gpt_count_is_6n_plus_attention(layers, hidden, seq):
    with torch.device("meta"):
        model = build_gpt(layers=layers, heads=4, hidden=hidden, seq_len=seq)
    tokens = torch.zeros(seq, dtype=torch.long)
    counted = count_flops(model, CROSS_ENTROPY, *meta_batch((tokens, tokens), 3))
    matrices = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2)
    lookups = model.embed.tok.weight.numel() + model.embed.pos.weight.numel()  # no multiply
    params = matrices - lookups  # the blocks' linear layers and the output head
    want = transformer_flops(params=params, layers=layers, hidden=hidden, seq=seq, tokens=3 * seq)
    assert counted == want


def test_a_convolutional_model_is_counted_too():
    with torch.device("meta"):
        model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.Flatten(), nn.Linear(8 * 8 * 8, 10))
    image, label = torch.zeros(1, 8, 8), torch.tensor(0)
    counted = count_flops(model, CROSS_ENTROPY, *meta_batch((image, label), 4))
    conv = 2 * 8 * 9 * 64 * 4  # multiply-adds per output pixel × outputs × batch
    linear = 2 * 512 * 10 * 4
    # forward; backward: the weights' gradients of both, the activations' of the linear only
    assert counted == 3 * linear + 2 * conv


class ReadsAValue(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum().item() > 0:  # data-dependent: no meta tensor has a value
            return self.layer(x)
        return -self.layer(x)


def test_a_model_that_cannot_run_on_meta_says_why_and_reports_no_mfu():
    sample = (torch.zeros(4), torch.tensor(0))
    found = for_run(
        ReadsAValue,
        CROSS_ENTROPY,
        sample,
        micro_batch=2,
        global_batch=4,
        peak=lambda: measure_peak(torch.device("cpu"), torch.float32),
    )
    assert isinstance(found, str) and "could not be counted on the meta device" in found


def test_mfu_is_against_the_measured_peak():
    peak = measure_peak(torch.device("cpu"), torch.float32)
    assert 1e8 < peak.measured < 1e13 and peak.vendor is None
    assert "measured (float32 matrix multiply)" in peak.describe()
    use = Utilisation(flops_per_step=peak.measured, peak=Peak(2e12, torch.float32))
    window = use.window(steps=4, seconds=2.0, devices=2)
    assert window["tflops"] == pytest.approx(peak.measured / 1e12)
    assert window["mfu"] == pytest.approx(100 * peak.measured / 2e12)


def test_a_model_that_cannot_run_on_meta_is_counted_on_a_real_micro_batch_leaving_it_as_it_was():
    """The count runs the run's own model once (dropout, BatchNorm): every random state, buffer
    and gradient is as before, and the count is the one the meta device gives a model that can
    run there."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2))
    data = [(torch.randn(4), torch.tensor(i % 2)) for i in range(6)]
    state = torch.get_rng_state()
    buffers = {k: v.clone() for k, v in model.state_dict().items() if "running" in k}
    real = count_real(
        model,
        CROSS_ENTROPY,
        data,
        micro_batch=3,
        device=torch.device("cpu"),
        precision="fp32",
    )
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in buffers.items())
    assert all(p.grad is None for p in model.parameters())
    with torch.device("meta"):
        meta = copy.deepcopy(model).to("meta")
    assert real == count_flops(meta, CROSS_ENTROPY, *meta_batch(data[0], 3))
    found = for_run(
        ReadsAValue,
        CROSS_ENTROPY,
        data[0],
        micro_batch=3,
        global_batch=6,
        peak=lambda: Peak(1e12, torch.float32),
        real=lambda: real,
    )
    assert isinstance(found, Utilisation)
    assert found.flops_per_step == 2 * real and "real micro-batch" in found.describe()


def test_the_peak_comes_from_the_calibrated_profile_measured_on_this_device(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDWISE_CACHE", str(tmp_path))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a CPU profile is per core: a rank of one thread
    try:
        profile = {"peak_flops": 1.25e11, "calibrated": True, "device": "cpu"}
        (tmp_path / "this-machine.json").write_text(json.dumps(profile))
        peak = measure_peak(torch.device("cpu"), torch.float32)
        assert peak.measured == 1.25e11 and "calibrated profile" in peak.describe()
        # another device's profile, or another precision: measured here
        profile["device"] = "NVIDIA H200"
        (tmp_path / "this-machine.json").write_text(json.dumps(profile))
        peak = measure_peak(torch.device("cpu"), torch.float32)
        assert peak.source == "measured"
        assert "is not used: it was measured on NVIDIA H200, not cpu" in peak.describe()
        profile["device"] = "cpu"
        (tmp_path / "this-machine.json").write_text(json.dumps(profile))
        peak = measure_peak(torch.device("cpu"), torch.bfloat16)
        assert peak.source == "measured" and "this run multiplies in torch.bfloat16" in peak.unused
        torch.set_num_threads(2)  # a CPU profile's peak is one core's
        peak = measure_peak(torch.device("cpu"), torch.float32)
        assert "its peak is per core, and this rank runs 2 threads" in peak.describe()
        (tmp_path / "this-machine.json").unlink()  # no profile: nothing to say about one
        assert measure_peak(torch.device("cpu"), torch.float32).unused == ""
    finally:
        torch.set_num_threads(threads)


def test_mfu_against_the_data_sheet_is_reported_beside_the_measured_one():
    peak = Peak(8e14, torch.bfloat16, vendor=("NVIDIA H200", 989e12))
    window = Utilisation(flops_per_step=4e14, peak=peak).window(steps=1, seconds=1.0, devices=1)
    assert window["mfu"] == pytest.approx(50.0)
    assert window["mfu_datasheet"] == pytest.approx(100 * 4e14 / 989e12)
    assert peak.mfu_text(4e14) == "MFU 50.0% (40.4% of the data sheet's)"
