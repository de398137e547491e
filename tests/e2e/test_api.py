"""`shardwise.train` from Python, and the training options a job can switch on."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

import shardwise
from helpers import digits_job, losses

pytestmark = pytest.mark.slow


def test_python_api_returns_a_summary(tmp_path):
    config = digits_job(
        tmp_path, tracking={"mlflow": True, "log_every": 5}, eval={"every_steps": 10}
    )
    summary = shardwise.train(config, nproc=2)
    assert isinstance(summary, shardwise.TrainSummary)
    assert summary.step == 20
    assert Path(summary.checkpoint).name == "step_00000020"
    assert {"loss", "lr", "samples/s", "eval/loss", "eval/accuracy"} <= set(summary.metrics)
    client = MlflowClient(tracking_uri=config.tracking_uri)
    assert client.get_run(summary.mlflow_run_id).data.metrics["loss"] == pytest.approx(
        summary.metrics["loss"]
    )


@pytest.mark.parametrize(
    "train",
    [
        {"precision": "bf16", "micro_batch": 8},
        {"precision": "fp16", "micro_batch": 8},
        {
            "optimizer": "sgd",
            "lr": 0.1,
            "lr_scaling": "linear",
            "lr_base_batch": 16,
            "decay": "linear",
            "grad_clip": 0.0,
        },
    ],
)
def test_precision_and_optimizer_options_train(tmp_path, train):
    shardwise.train(digits_job(tmp_path, train=train), nproc=2)
    curve = losses(tmp_path)
    assert all(math.isfinite(v) for v in curve.values())
    assert curve[20] < curve[1] - 0.05  # it learns (from ln 10 = 2.30)
