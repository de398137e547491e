"""Credentials in URIs stay in memory: a training run and a many-models run tracked on a real
MLflow server whose URI carries a password write it nowhere (console, run directory, the MLflow
store's params, tags and artifacts), and an error line naming such a URI hides it too."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import helpers

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]
SECRET = "s3cr3t-Pa55"


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """An MLflow tracking server on loopback, its store and artifacts in a temp dir."""
    root = tmp_path_factory.mktemp("mlflow-server")
    with helpers.mlflow_server(root) as port:
        yield root, f"http://alice:{SECRET}@127.0.0.1:{port}"


def holding(root: Path, text: str) -> list[Path]:
    """The files under `root` whose bytes contain `text`."""
    return [p for p in root.rglob("*") if p.is_file() and text.encode() in p.read_bytes()]


shardwise = helpers.shardwise_command


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
