"""Fixtures shared by every test: small job configs, a guard that fails any test that leaves
a child process behind, and one temporary directory for the session's processes, removed at its
end."""

from __future__ import annotations

import json
import multiprocessing.util
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from helpers import children_of

REPO = Path(__file__).resolve().parents[1]


SPARK_CONF = "SPARK_CONF_DIR"
SPARK_JVM_OPTIONS = "-XX:TieredStopAtLevel=1"
"""The Spark JVMs' options in the tests: their just-in-time compiler stops at its quick first
tier. The tests' Spark jobs are small and short, and C2, the optimising tier, spent more CPU
compiling than it saved: tests/integration/test_features_spark.py's JVMs took 108 CPU-s with it
and 53 without (67 -> 51 s), the Spark launch test's 76 and 41 (144 -> 120 s). A cluster's own
long jobs want C2: this is the tests' site configuration, not shardwise's."""


def _spark_site_configuration(directory: Path) -> str:
    """A Spark configuration directory (SPARK_CONF_DIR, read by spark-submit as a cluster's
    spark-defaults.conf is) whose defaults give the driver's and executors' JVMs
    SPARK_JVM_OPTIONS; a local cluster's master and workers run in the driver's JVM."""
    directory.mkdir()
    (directory / "spark-defaults.conf").write_text(
        f"spark.driver.extraJavaOptions {SPARK_JVM_OPTIONS}\n"
        f"spark.executor.extraJavaOptions {SPARK_JVM_OPTIONS}\n"
    )
    return str(directory)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest test files first (tests/file_durations.json, from a measured run), so that
    `make test`'s two workers (`--dist loadfile`: a file's tests on one worker) end together: in
    pytest's order, the Spark launch test (144 s) ran last on one worker while the other had
    finished. Files it does not list run after those it does; within a file, pytest's order."""
    seconds = json.loads((REPO / "tests" / "file_durations.json").read_text())
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], 0))


@pytest.fixture(scope="session", autouse=True)
def _temporary_files(tmp_path_factory):
    """Every temporary file of the session, the libraries' included, goes to one directory
    that is removed at the end (TMPDIR, which Python's tempfile, Ray and torch read): MLflow's
    database locks, torch's error files and compile cache, torchrun's logs, Ray's sessions,
    MLflow's downloaded models were left in /tmp by every run before. Each pytest worker has
    its own, so torch's compile cache starts cold as it does on a fresh machine. shardwise's
    cache (SHARDWISE_CACHE: MLflow's empty store, a calibrated profile) is in it too. A short
    path: Ray puts Unix sockets in it (107 bytes at most). pytest's own directory is fixed
    first, to stay where it is and be kept for inspection."""
    tmp_path_factory.getbasetemp()
    # multiprocessing's own directory (its sockets) stays where it is too: it removes it itself
    # when this process exits, after the session's directory is gone
    multiprocessing.util.get_temp_dir()
    before = {name: os.environ.get(name) for name in ("TMPDIR", "SHARDWISE_CACHE", SPARK_CONF)}
    root = tempfile.mkdtemp(prefix="sw-tests-")
    os.environ["TMPDIR"] = root
    # shardwise's cache (MLflow's empty store, a calibrated profile) starts empty and goes too:
    # nothing of this machine's own cache is read, and nothing is left in it
    os.environ["SHARDWISE_CACHE"] = os.path.join(root, "shardwise-cache")
    if before[SPARK_CONF] is None:
        os.environ[SPARK_CONF] = _spark_site_configuration(Path(root) / "spark-conf")
    tempfile.tempdir = None  # read TMPDIR again
    yield
    import command_server

    command_server.stop()  # the server of `shardwise` commands, started with TMPDIR in there
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    tempfile.tempdir = None
    shutil.rmtree(root, ignore_errors=True)


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
