"""Fixtures shared by every test: small job configs, and a guard that fails any test that leaves
a child process behind."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from helpers import children_of

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _no_leaked_processes():
    before = set(children_of(os.getpid()))
    yield
    deadline = time.monotonic() + 10
    leaked = set(children_of(os.getpid())) - before
    while leaked and time.monotonic() < deadline:  # give exiting children time to be reaped
        time.sleep(0.1)
        leaked = set(children_of(os.getpid())) - before
    assert not leaked, f"test left child processes behind: {sorted(leaked)}"


@pytest.fixture
def repo_cwd(monkeypatch):
    """Run from the repository root, as the README's commands do."""
    monkeypatch.chdir(REPO)
    return REPO
