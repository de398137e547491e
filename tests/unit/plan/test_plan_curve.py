"""The planner's compute rate as a curve by layer size: a layer's forward and backward take
t = F / (utilisation · peak) + layer_overhead per micro-batch, so small layers (a small model, or
a small micro-batch) reach far less of the peak than large ones.

The H200 figures are issue 17's (one H200, bf16 autocast, the built-in GPT on `text`: vocabulary
256, sequence 1024, micro-batch 16, one process): 38.3 ms per step at 86M parameters measured;
at 304M and 1.2B the issue gives the fixed-50% preset's prediction as 0.76× and 0.98× the
measured time, which puts the measured steps at 99.9 and 289.3 ms."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shardwise.plan.calibrate import fit_layer_curve
from shardwise.plan.hardware import PRESETS
from shardwise.plan.layout import PRECISIONS, Layout
from shardwise.plan.model import Transformer
from shardwise.plan.timing import achieved_utilisation, step_time

AUTOCAST = PRECISIONS["bf16-autocast"]
ISSUE_17_H200 = [  # (layers, heads, hidden), measured seconds per step
    ((12, 12, 768), 38.3e-3),
    ((24, 16, 1024), 99.9e-3),
    ((24, 16, 2048), 289.3e-3),
]


def _gpt(layers: int, heads: int, hidden: int) -> Transformer:
    return Transformer(layers=layers, hidden=hidden, heads=heads, vocab=256, seq=1024)


@pytest.mark.parametrize(("shape", "measured"), ISSUE_17_H200, ids=["86M", "304M", "1.2B"])
def test_h200_preset_predicts_issue_17s_steps_within_15_percent(shape, measured):
    predicted = step_time(_gpt(*shape), Layout(micro_batch=16), AUTOCAST, PRESETS["h200"]).total
    assert predicted / measured == pytest.approx(1, abs=0.15)


def test_small_models_reach_less_of_the_peak_than_large_ones():
    h200 = PRESETS["h200"]
    shares = [
        achieved_utilisation(_gpt(*shape), Layout(micro_batch=16), h200)
        for shape, _ in ISSUE_17_H200
    ]
    assert shares == sorted(shares) and shares[0] < 0.35 < 0.45 < shares[-1] < h200.utilisation


def test_micro_batch_1_is_slower_per_sample_than_16():
    model, h200 = _gpt(12, 12, 768), PRESETS["h200"]
    one = step_time(model, Layout(micro_batch=1, microbatches=16), AUTOCAST, h200)
    sixteen = step_time(model, Layout(micro_batch=16), AUTOCAST, h200)
    assert one.compute > 1.5 * sixteen.compute
    assert achieved_utilisation(model, Layout(micro_batch=1), h200) < 0.5 * achieved_utilisation(
        model, Layout(micro_batch=16), h200
    )


def test_the_overhead_is_per_layer_on_the_busiest_stage_and_per_micro_batch():
    model = _gpt(12, 12, 768)
    flat = replace(PRESETS["h200"], layer_overhead=0.0)
    curved = replace(flat, layer_overhead=1e-3)

    def extra(layout: Layout) -> float:
        return (
            step_time(model, layout, AUTOCAST, curved).compute
            - step_time(model, layout, AUTOCAST, flat).compute
        )

    assert extra(Layout(micro_batch=4, microbatches=3)) == pytest.approx(12 * 3 * 1e-3)
    assert extra(Layout(pp=4, micro_batch=4, microbatches=3)) == pytest.approx(3 * 3 * 1e-3)
    assert extra(Layout(tp=2, micro_batch=4)) == pytest.approx(12 * 1e-3)  # same kernels, halved
    # full recomputation replays each layer's forward: a third more passes
    full = Layout(micro_batch=4, recompute="full")
    assert extra(full) == pytest.approx(12 * 1e-3 * 4 / 3)


def test_a_flat_rate_without_overhead_is_the_old_model():
    model, h200 = _gpt(24, 16, 2048), replace(PRESETS["h200"], layer_overhead=0.0)
    layout = Layout(micro_batch=16)
    flops = 16 * 1024 * model.train_flops_per_token()
    assert step_time(model, layout, AUTOCAST, h200).compute == pytest.approx(
        flops / (h200.peak_flops * h200.utilisation)
    )
    assert achieved_utilisation(model, layout, h200) == pytest.approx(h200.utilisation)


def test_fit_layer_curve_recovers_a_known_line_and_never_goes_negative():
    peak = 1e12
    points = [(f, f / (0.6 * peak) + 2e-4) for f in (1e9, 4e9)]
    utilisation, overhead = fit_layer_curve(points, peak)
    assert utilisation == pytest.approx(0.6) and overhead == pytest.approx(2e-4)
    # noise that would make the overhead negative: none, and the larger layer's rate
    noisy = [(1e9, 1.0e-3), (4e9, 4.2e-3)]
    utilisation, overhead = fit_layer_curve(noisy, peak)
    assert overhead == 0 and utilisation == pytest.approx(4e9 / 4.2e-3 / peak)


def test_the_a100_curve_is_near_megatrons_measured_rates():
    """Narayanan et al. 2021, Table 1 (A100s, full recomputation, micro-batch 1): the preset's
    curve predicts the rate of the compute alone, the recomputed forward counted as the paper
    counts it, at 0.84–1.01× the paper's rates (which include communication and the bubble): a
    little pessimistic, where a flat 50% is 0.96–1.14×."""
    from test_plan import MEGATRON_TABLE_1, S, V

    a100 = PRESETS["a100-80gb"]
    for _, heads, hidden, layers, tp, pp, gpus, batch, tflops in MEGATRON_TABLE_1:
        model = Transformer(layers=layers, hidden=hidden, heads=heads, vocab=V, seq=S)
        dp = gpus // (tp * pp)
        layout = Layout(dp=dp, tp=tp, pp=pp, microbatches=batch // dp, recompute="full")
        flops = batch * S * model.train_flops_per_token("full") / gpus
        predicted = flops / step_time(model, layout, AUTOCAST, a100).compute / 1e12
        assert 0.8 <= predicted / tflops <= 1.05, (hidden, predicted, tflops)
