"""A replacement replica healed from a live peer's memory (fault/heal.py), on a real 2-rank gloo
group: the peer trained three steps; the replacement, built from the same job with another seed
and one step of its own, receives the peer's parameters, buffers (a BatchNorm's running
statistics), tied weights and AdamW state (moments and step counters) and hyperparameters, and
is then `torch.equal` to it, and stays so over a further identical step. A replacement built
from another job is refused in one error on both sides before any tensor moves."""

from __future__ import annotations

import multiprocessing
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from shardwise.training.fault.heal import (
    HealError,
    load_param_groups,
    receive_state,
    send_state,
    state_of,
)
from shardwise.training.fault.membership import current, group, publish
from shardwise.training.launch.stores import LOOPBACK, host_store

pytestmark = pytest.mark.slow
TIMEOUT_S = 60.0


class Tied(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.norm = nn.BatchNorm1d(width)
        self.mix = nn.Linear(width, width)
        self.again = nn.Linear(width, width)
        self.again.weight = self.mix.weight  # tied: one tensor under two names
        self.out = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.mix(torch.relu(self.norm(self.embed(x)))))
        return self.out(self.again(hidden))


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    batch = torch.Generator().manual_seed(seed)
    x, y = torch.randn(16, 8, generator=batch), torch.randn(16, 8, generator=batch)
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()


def _replica(slot: int, port: int, width: int, out: str) -> None:
    store = TCPStore(LOOPBACK, port, is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
    pg = group(store, current(store, TIMEOUT_S), slot, TIMEOUT_S)
    torch.manual_seed(100 + slot)  # not the same start
    model = Tied(width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01 * (slot + 1), betas=(0.8, 0.9))
    result: dict[str, object] = {}
    try:
        if slot == 0:  # the live peer
            for seed in range(3):
                _step(model, optimizer, seed)
            tensors, extra = state_of(model, optimizer)
            result["bytes"] = send_state(pg, 1, tensors, {**extra, "step": 3})
        else:  # the replacement
            _step(model, optimizer, 99)  # its optimizer's state exists, to be received into
            tensors, _ = state_of(model, optimizer)
            extra = receive_state(pg, 0, tensors)
            load_param_groups(optimizer, extra)
            result["step"] = extra["step"]
    except HealError as e:
        result["error"] = str(e)
    else:
        result["healed"] = {k: v.detach().clone() for k, v in state_of(model, optimizer)[0].items()}
        _step(model, optimizer, 7)
        result["after"] = {k: v.detach().clone() for k, v in state_of(model, optimizer)[0].items()}
        result["lr"] = optimizer.param_groups[0]["lr"]
    torch.save(result, Path(out) / f"slot{slot}.pt")


def _heal(tmp_path: Path, widths: tuple[int, int]) -> tuple[dict, dict]:
    store = host_store(
        LOOPBACK, 0, world_size=None, timeout=timedelta(seconds=TIMEOUT_S), multi_tenant=False
    )
    publish(store, 0, [0, 1])
    context = multiprocessing.get_context("spawn")
    replicas = [
        context.Process(target=_replica, args=(slot, store.port, widths[slot], str(tmp_path)))
        for slot in (0, 1)
    ]
    for process in replicas:
        process.start()
    for process in replicas:
        process.join(TIMEOUT_S)
        assert process.exitcode == 0
    return tuple(torch.load(tmp_path / f"slot{s}.pt", weights_only=True) for s in (0, 1))


def test_a_replacement_heals_bitwise_from_a_live_peer(tmp_path):
    peer, joiner = _heal(tmp_path, (16, 16))
    assert joiner["step"] == 3 and joiner["lr"] == peer["lr"] == 0.01
    assert peer["bytes"] > 0
    for key in ("healed", "after"):
        assert peer[key].keys() == joiner[key].keys()
        assert any(name.endswith("/exp_avg_sq") for name in peer[key])
        assert any(name.endswith("running_mean") for name in peer[key])
        for name, value in peer[key].items():
            assert torch.equal(value, joiner[key][name]), (key, name)


def test_a_replacement_from_another_job_is_refused_before_any_tensor_moves(tmp_path):
    peer, joiner = _heal(tmp_path, (16, 12))
    assert "does not match" in peer["error"] and "does not match" in joiner["error"]
    assert "first: 'model/embed.weight'" in joiner["error"]
