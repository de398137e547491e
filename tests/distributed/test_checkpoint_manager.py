"""The checkpoint manager in one in-process rank: what torch's versions do differently under it."""

from __future__ import annotations

import torch

from shardwise.training.checkpoint.disk_layout import problem
from shardwise.training.checkpoint.manager import CheckpointManager


def test_async_saves_go_on_after_torch_closed_the_stager(one_rank, tmp_path):
    """torch 2.11's DefaultStager closes its copier at the end of every stage (2.13's keeps it,
    with its pinned copies, for the next save). On an H100 with torch 2.11 a run's second async
    save failed with `KeyError: <class 'type'>`: the manager stages with a new one instead."""
    root = tmp_path / "checkpoints"
    manager = CheckpointManager(str(root), keep_last=3, asynchronous=True)
    state = {"weight": torch.arange(6.0), "position": {"epoch": 1, "seed": 7, "name": "a"}}
    kept = manager._stager
    for step in (1, 2, 3):
        manager.save(step, state, {})
        assert manager.wait() == str(root / f"step_{step:08d}")
        assert (manager._stager is kept) == (step == 1)  # reused while torch keeps it open
        manager._stager.close()  # what torch 2.11 does at the end of each stage
    assert sorted(p.name for p in root.iterdir()) == [f"step_{s:08d}" for s in (1, 2, 3)]
    assert all(problem(root / f"step_{s:08d}") is None for s in (1, 2, 3))
