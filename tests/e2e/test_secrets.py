"""Credentials in URIs stay in memory: a training run and a many-models run tracked on a real
MLflow server whose URI carries a password write it nowhere (console, run directory, the MLflow
store's params, tags and artifacts), and an error line naming such a URI hides it too."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from helpers import free_port

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]
SECRET = "s3cr3t-Pa55"


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """An MLflow tracking server on loopback, its store and artifacts in a temp dir."""
    root = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    server = subprocess.Popen(
        [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1", "--backend-store-uri", f"sqlite:///{root / 'store.db'}",
         "--artifacts-destination", str(root / "artifacts")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, "no MLflow server"
                time.sleep(0.5)
        yield root, f"http://alice:{SECRET}@127.0.0.1:{port}"
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)


def holding(root: Path, text: str) -> list[Path]:
    """The files under `root` whose bytes contain `text`."""
    return [p for p in root.rglob("*") if p.is_file() and text.encode() in p.read_bytes()]


def shardwise(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "shardwise"), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )


def test_a_tracked_training_run_writes_the_password_nowhere(tmp_path, mlflow_server):
    store, uri = mlflow_server
    done = shardwise(
        "train", "examples/digits.toml", "--nproc", "2",
        "--set", f"job.run_dir={tmp_path}", "--set", "train.steps=4",
        "--set", f"tracking.uri='{uri}'",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "mlflow run:" in done.stdout
    assert SECRET not in done.stdout + done.stderr
    assert "http://***@127.0.0.1" in done.stdout  # the resolved config, shown redacted
    assert holding(tmp_path, SECRET) == []
    assert holding(store, SECRET) == []
    assert holding(store, "http://***@127.0.0.1") != []  # the params did reach the server


def test_a_tracked_many_models_run_writes_the_password_nowhere(tmp_path, mlflow_server):
    store, uri = mlflow_server
    done = shardwise(
        "many-models", "examples/retail-synthetic.toml",
        "--set", f"job.run_dir={tmp_path}", "--set", "data.num_series=4",
        "--set", "models.names=['seasonal_naive']", "--set", f"tracking.uri='{uri}'",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "mlflow run:" in done.stderr
    assert SECRET not in done.stdout + done.stderr
    assert "http://***@127.0.0.1" in (tmp_path / "job.toml").read_text()
    assert holding(tmp_path, SECRET) == []
    assert holding(store, SECRET) == []


def test_an_error_line_hides_the_password(tmp_path):
    done = shardwise(
        "export", f"http://alice:{SECRET}@127.0.0.1:9/runs/x/checkpoints/step_00000001",
        str(tmp_path / "out.safetensors"),
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "http://***@127.0.0.1:9" in done.stderr
    assert SECRET not in done.stdout + done.stderr
