"""Fixtures for tests in this directory."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist


@pytest.fixture
def one_rank(tmp_path):
    """A default process group of one gloo rank, in this test's process."""
    store = dist.FileStore(os.fspath(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()
