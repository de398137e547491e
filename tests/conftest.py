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


@pytest.fixture
def s3(monkeypatch):
    """An S3-compatible server (moto) on a loopback port of its own, with an empty bucket
    `checkpoints`; the workers reach it through the standard AWS environment variables. Yields
    an fsspec filesystem of it."""
    import logging
    import urllib.request

    import fsspec
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    for name, value in {
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.clear_instance_cache()  # fsspec reuses instances, with the previous server's endpoint
    fs.mkdir("checkpoints")
    yield fs
    fs.clear_instance_cache()
    urllib.request.urlopen(  # moto keeps its buckets in this process: forget them
        urllib.request.Request(f"http://{host}:{port}/moto-api/reset", method="POST")
    ).close()
    server.stop()
