import math

import pytest
import torch

from shardwise.training.config.schema import TrainSection
from shardwise.training.trainer.optim import build_optimizer, lr_factor, states_per_param


def train(**kw):
    return TrainSection(steps=100, global_batch=8, **kw)


def test_warmup_then_cosine_to_floor():
    t = train(warmup_steps=10, decay="cosine", min_lr_ratio=0.1)
    assert lr_factor(1, t) == pytest.approx(0.1)
    assert lr_factor(10, t) == pytest.approx(1.0)
    assert lr_factor(55, t) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(100, t) == pytest.approx(0.1)


def test_linear_and_constant():
    assert lr_factor(50, train(decay="linear")) == pytest.approx(0.5)
    assert lr_factor(50, train(decay="constant")) == 1.0
    assert lr_factor(100, train(decay="cosine")) == pytest.approx(0.0, abs=1e-12)
    assert math.isclose(lr_factor(25, train(decay="cosine")), 0.5 * (1 + math.cos(math.pi / 4)))


def test_weight_decay_skips_biases_and_norms():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    opt = build_optimizer(model, train(weight_decay=0.1), lr=1e-3)
    decayed, plain = opt.param_groups
    assert decayed["weight_decay"] == 0.1 and len(decayed["params"]) == 1
    assert plain["weight_decay"] == 0.0 and len(plain["params"]) == 3
    sgd = build_optimizer(model, train(optimizer="sgd", momentum=0.8), lr=0.1)
    assert isinstance(sgd, torch.optim.SGD) and sgd.param_groups[0]["momentum"] == 0.8


@pytest.mark.parametrize(("optimizer", "momentum"), [("adamw", 0.9), ("sgd", 0.9), ("sgd", 0.0)])
def test_the_dry_runs_count_of_optimizer_states_is_what_the_optimizer_keeps(optimizer, momentum):
    train = TrainSection(steps=10, global_batch=8, optimizer=optimizer, momentum=momentum)
    model = torch.nn.Linear(3, 2)
    opt = build_optimizer(model, train, lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    kept = [
        sum(isinstance(v, torch.Tensor) and v.shape == p.shape for v in opt.state[p].values())
        for p in model.parameters()
    ]
    assert set(kept) == {states_per_param(train)}
