"""comm/collectives.py on a one-rank gloo group: the renamed collectives run under their new
names where torch has them (no deprecation warning) and under the old ones where it does not
(torch before 2.13, which shardwise supports)."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from shardwise.training.comm.collectives import all_gather_single, reduce_scatter_single


def run_both() -> tuple[torch.Tensor, torch.Tensor]:
    gathered, scattered = torch.empty(3), torch.empty(3)
    all_gather_single(gathered, torch.tensor([1.0, 2.0, 3.0]))
    reduce_scatter_single(scattered, torch.tensor([4.0, 5.0, 6.0]))
    return gathered, scattered


def test_the_new_names_run_without_a_deprecation_warning(one_rank):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gathered, scattered = run_both()
    assert gathered.tolist() == [1.0, 2.0, 3.0] and scattered.tolist() == [4.0, 5.0, 6.0]


def test_a_torch_without_the_new_names_gets_the_old_ones(one_rank, monkeypatch):
    for name in ("all_gather_single", "reduce_scatter_single"):
        monkeypatch.delattr(dist, name, raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the old names warn on torch ≥ 2.13
        gathered, scattered = run_both()
    assert gathered.tolist() == [1.0, 2.0, 3.0] and scattered.tolist() == [4.0, 5.0, 6.0]


def test_the_health_check_runs_on_a_torch_without_the_new_names(one_rank, monkeypatch):
    """What crashed on torch 2.11 (calibration's `reduce_scatter_single`), for a caller here."""
    from shardwise.training.fault.health import RankHealth

    monkeypatch.delattr(dist, "all_gather_single", raising=False)
    checks = RankHealth(straggler_factor=0, straggler_windows=3, every=4, interval_s=0.0)
    checks.add(own=0.01, step=0.02)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        assert not checks.check().stop
