"""Float8 training (`train.float8`, parallel/float8.py) on the CPU, in torchao's emulation: which
layers convert, what conversion keeps, the converted layers' numerics against fp32 (torchao's
own thresholds), and the combinations refused before launch."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from helpers import gpt_job
from shardwise.common.errors import ConfigError
from shardwise.models.gpt import GPT
from shardwise.training.config.derive import derive
from shardwise.training.parallel.float8 import Float8, chosen, convert

pytest.importorskip("torchao", reason="the float8 extra: pip install 'shardwise[float8]'")


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(1024, 4096)  # k 1024, n 4096: gains under tensorwise
        self.small = nn.Linear(256, 256)  # too small to gain
        self.odd = nn.Linear(200, 1000)  # not multiples of 16
        self.head = nn.Linear(4096, 1024, bias=False)  # k 4096, n 1024: too small (tensorwise)


def test_auto_converts_what_gains_and_never_dimensions_float8_cannot_multiply():
    take, left = chosen(_Net(), "tensorwise", "auto")
    assert take == ["big"]
    assert left == [
        "small (256×256: too small to gain)",
        "odd (200×1000: not multiples of 16)",
        "head (4096×1024: too small to gain)",
    ]
    # rowwise needs larger layers still (n > 2048 and k > 1024, or larger)
    assert chosen(_Net(), "rowwise", "auto")[0] == []


def test_named_layers_convert_as_named_but_never_odd_dimensions():
    take, left = chosen(_Net(), "tensorwise", ["sm*", "odd", "head"])
    assert take == ["small", "head"]
    assert left == ["odd (200×1000: not multiples of 16)"]
    with pytest.raises(ConfigError, match=r"'\*\.mlp\.up' names no linear layer .*big, small"):
        chosen(_Net(), "tensorwise", ["*.mlp.up"])


def test_conversion_keeps_what_the_model_set_on_a_layer_for_its_initialisation():
    """The built-in GPT marks its residual projections with `init_std`, read when it initialises
    its weights (after sharding, on meta-built models): torchao's swap drops such attributes."""
    with torch.device("meta"):
        model = GPT(vocab=256, seq_len=32, layers=2, heads=2, hidden=64, mlp_ratio=4, dropout=0.0)
    residual = model.layers["0"].attn.proj.init_std
    assert residual < 0.02
    plan = Float8("tensorwise", ["*.proj", "*.down", "*.up"], emulate=True, all_gather=False)
    lines = convert(model, plan, compiled=False)
    assert lines[0].startswith("float8 (tensorwise, emulated): 6 linear layers converted: ")
    assert "train.compile is off" in lines[-1]
    model.to_empty(device="cpu")
    model.apply(GPT.init_weights)
    for block in model.layers.values():
        assert type(block.attn.proj).__name__ == "Float8Linear"
        assert block.attn.proj.init_std == residual and block.mlp.down.init_std == residual
        assert block.attn.proj.weight.std().item() == pytest.approx(residual, rel=0.1)
        assert block.mlp.up.weight.std().item() == pytest.approx(0.02, rel=0.1)


def _sqnr(reference: torch.Tensor, got: torch.Tensor) -> float:
    """Signal to quantisation noise, in dB (torchao's measure); infinite where there is none
    (`rowwise_with_gw_hp` computes the weight gradient in high precision)."""
    noise = (reference - got).norm().item()
    return math.inf if noise == 0 else 20 * math.log10(reference.norm().item() / noise)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_a_float8_layer_matches_fp32_within_torchaos_own_thresholds(recipe):
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(256, 512))
    x = torch.randn(64, 256, requires_grad=True)
    converted = nn.Sequential(nn.Linear(256, 512))
    converted.load_state_dict(reference.state_dict())
    convert(converted, Float8(recipe, ["0"], emulate=True, all_gather=False), compiled=True)
    assert type(converted[0]).__name__ == "Float8Linear"
    want, got = reference(x), converted(x)
    grad = torch.randn_like(want)
    want.backward(grad)
    got.backward(grad)
    assert _sqnr(want, got) >= 18  # torchao's test/float8/test_base.py
    assert _sqnr(reference[0].weight.grad, converted[0].weight.grad) >= 17
    torch.testing.assert_close(converted[0].bias.grad, reference[0].bias.grad)


@pytest.mark.parametrize(
    ("train", "parallel", "why"),
    [
        ({"precision": "fp16"}, {}, "not fp16's gradient scaler"),
        ({}, {"tp": 2}, "tensor parallelism"),
        ({"float8": "rowwise", "float8_all_gather": True}, {"dp_shard": 2}, "'tensorwise'"),
        ({"float8_all_gather": True}, {}, "under FSDP only"),
    ],
)
def test_what_float8_cannot_do_is_refused_in_one_line(tmp_path, train, parallel, why):
    config = gpt_job(tmp_path, train={"float8": "tensorwise", **train}, parallel=parallel)
    with pytest.raises(ConfigError, match=why):
        derive(config, 2)


def test_the_float8_all_gather_without_float8_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"float8_all_gather needs train\.float8"):
        derive(gpt_job(tmp_path, train={"float8_all_gather": True}), 2)
