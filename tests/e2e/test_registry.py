"""Trained models in MLflow's Model Registry, against a real `mlflow server` the tests start: a
job with `tracking.log_model` (under FSDP, and as a two-stage pipeline) and `shardwise export
--mlflow` register versions that `mlflow.pyfunc.load_model("models:/NAME/1")` loads and that
predict what the trained model predicts: their cross-entropy over the held-out samples is the
run's own final eval loss (which the trainer computed with the sharded model; in fp32, as the
logged model predicts). A version served by
`mlflow models serve --env-manager local` answers a REST request with the same predictions. A
many-models run registers its chosen forecasts and intervals, looked up by series id. A
store that is down costs one line and exit 2, and the checkpoint stays intact."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F  # noqa: N812

import helpers
from shardwise.training import job_names
from shardwise.training.checkpoint.disk_layout import problem, read_manifest
from shardwise.training.config.load import validate
from shardwise.training.tracking.metrics import read_metrics

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]
SHORT_GPT = ["--set", "data.args.max_bytes=200000", "--set", "eval.max_samples=16"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with helpers.mlflow_server(tmp_path_factory.mktemp("mlflow")) as port:
        yield f"http://127.0.0.1:{port}"


shardwise = helpers.shardwise_command


def train(job: str, run_dir: Path, nproc: int, *overrides: str) -> subprocess.CompletedProcess:
    sets = [a for o in overrides for a in ("--set", o)]
    done = shardwise("train", job, "--nproc", str(nproc), "--set", f"job.run_dir={run_dir}", *sets)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def registered(uri: str, name: str) -> tuple[Any, dict[str, str]]:
    """Version 1 of `name` as `mlflow.pyfunc.load_model` gives it, and the version's tags."""
    import mlflow

    mlflow.set_tracking_uri(uri)
    version = mlflow.MlflowClient().get_model_version(name, "1")
    return mlflow.pyfunc.load_model(f"models:/{name}/1"), version.tags


def held_out_loss(model: Any, checkpoint: Path) -> float:
    """Cross-entropy of the logged model's predictions over the job's held-out samples (as many
    as the job's eval.max_samples), the job read from the checkpoint as export reads it."""
    config = validate(read_manifest(checkpoint)["job"])
    held_out = job_names.build_datasets(config)[1]
    count = min(len(held_out), config.eval.max_samples or len(held_out))
    inputs, target = torch.utils.data.default_collate([held_out[i] for i in range(count)])
    logits = torch.from_numpy(model.predict(inputs.numpy()))
    return F.cross_entropy(logits.flatten(0, -2).double(), target.flatten()).item()


def served_answer(model: str, server: str, cwd: Path, request: dict[str, Any]) -> Any:
    """What `mlflow models serve --env-manager local` of `model` answers to `request` (JSON) at
    /invocations; the server stopped after."""
    port = helpers.free_port()
    serving = subprocess.Popen(
        [str(BIN / "mlflow"), "models", "serve", "-m", model, "--env-manager", "local",
         "--host", "127.0.0.1", "--port", str(port)],
        # as from an activated virtualenv: MLflow starts `uvicorn` by name
        env={**os.environ, "MLFLOW_TRACKING_URI": server,
             "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}, cwd=cwd,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    try:
        posted = urllib.request.Request(
            f"http://127.0.0.1:{port}/invocations",
            data=json.dumps(request).encode(),
            headers={"Content-Type": "application/json"},
        )
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(posted, timeout=30) as answer:
                    return json.load(answer)
            except OSError:
                assert serving.poll() is None, serving.communicate()[1].decode()[-3000:]
                assert time.monotonic() < deadline, "mlflow models serve did not answer"
                time.sleep(0.5)
    finally:
        with contextlib.suppress(ProcessLookupError):  # the server and its workers
            os.killpg(serving.pid, signal.SIGTERM)
        serving.wait(timeout=60)


def final_checkpoint(run_dir: Path) -> Path:
    return sorted((run_dir / "checkpoints").glob("step_*"))[-1]


def test_a_digits_cnn_trained_under_fsdp_is_registered_and_predicts_its_eval_loss(server, tmp_path):
    run_dir = tmp_path / "run"
    done = train(
        "examples/digits.toml", run_dir, 2,
        "parallel.dp_shard=2", "parallel.dp_replicate=1", "train.steps=12",
        "checkpoint.every_steps=0", "eval.every_steps=0", f"tracking.uri={server}",
        "tracking.log_model=true", "tracking.registered_model=digits-fsdp",
    )  # fmt: skip
    assert "mlflow model: models:/digits-fsdp/1" in done.stdout
    model, tags = registered(server, "digits-fsdp")
    assert str(model.metadata.get_input_schema()) == "[Tensor('float32', (-1, 1, 8, 8))]"
    assert model.metadata.run_id == (run_dir / "mlflow_run_id").read_text()  # the training run
    assert tags["shardwise.step"] == "12"
    assert "dp_shard=2" in tags["shardwise.layout"]
    loss = held_out_loss(model, final_checkpoint(run_dir))
    assert loss == pytest.approx(float(tags["eval/loss"]), rel=1e-5)


def test_a_gpt_trained_as_a_two_stage_pipeline_is_registered_and_predicts_its_eval_loss(
    server, tmp_path
):
    run_dir = tmp_path / "run"
    done = train(
        "examples/text-gpt.toml", run_dir, 2,
        "parallel.pp=2", "train.steps=3", "train.precision=fp32", *SHORT_GPT[1::2],
        f"tracking.uri={server}",
        "tracking.log_model=true", "tracking.registered_model=gpt-pp2",
    )  # fmt: skip
    assert "mlflow model: models:/gpt-pp2/1" in done.stdout
    model, tags = registered(server, "gpt-pp2")
    assert model.metadata.get_input_schema().inputs[0].type == np.dtype("int64")
    assert "pp=2" in tags["shardwise.layout"]
    loss = held_out_loss(model, final_checkpoint(run_dir))
    assert loss == pytest.approx(float(tags["eval/loss"]), rel=1e-5)


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is not installed (pip install 'shardwise[hf]'; make does)",
)
def test_an_exported_hf_gpt2_is_registered_and_served_over_rest(server, tmp_path):
    run_dir = tmp_path / "run"
    train(
        "examples/hf-gpt2.toml", run_dir, 1,
        "train.steps=2", "train.precision=fp32", "eval.max_samples=16",
        "checkpoint.every_steps=0", "tracking.mlflow=false",
    )  # fmt: skip
    checkpoint = final_checkpoint(run_dir)
    done = shardwise("export", str(checkpoint), "--mlflow", "hf-gpt2", "--uri", server)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "registered models:/hf-gpt2/1" in done.stdout
    model, _ = registered(server, "hf-gpt2")
    evaluated = [r["eval/loss"] for r in read_metrics(run_dir / "metrics.jsonl")
                 if "eval/loss" in r]  # fmt: skip
    assert held_out_loss(model, checkpoint) == pytest.approx(evaluated[-1], rel=1e-5)

    example = model.input_example
    answer = served_answer("models:/hf-gpt2/1", server, tmp_path, {"inputs": example.tolist()})
    served = np.asarray(answer["predictions"], dtype=np.float32)
    np.testing.assert_allclose(served, model.predict(example), rtol=1e-5, atol=1e-5)


def test_a_many_models_run_is_registered_as_its_forecasts_by_series_and_served(server, tmp_path):
    run_dir = tmp_path / "run"
    done = shardwise(
        "many-models", "examples/retail-synthetic.toml", "--set", f"job.run_dir={run_dir}",
        "--set", "data.num_series=12", "--set", 'models.names=["seasonal_naive","ridge"]',
        "--set", "backtest.levels=[80,95]", "--set", f"tracking.uri={server}",
        "--set", "tracking.registered_model=retail",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "mlflow model: models:/retail/1" in done.stderr + done.stdout
    model, tags = registered(server, "retail")
    assert "intervals/coverage_80" in tags
    forecasts = pd.read_parquet(run_dir / "forecasts.parquet")
    asked = pd.DataFrame({"store": ["S000", "S000"], "item": ["I003", "I001"]})  # in this order
    got = model.predict(asked, params={"horizon": 2})
    assert got[["store", "item"]].drop_duplicates().values.tolist() == asked.values.tolist()
    assert list(got.columns) == list(forecasts.columns) and got["step"].max() == 2
    expected = forecasts.merge(asked).query("step <= 2").sort_values(["store", "item", "step"])
    pd.testing.assert_frame_equal(
        got.sort_values(["store", "item", "step"]).reset_index(drop=True),
        expected.reset_index(drop=True),
    )
    with pytest.raises(Exception, match="this model forecasts 1 to 4 steps"):
        model.predict(asked, params={"horizon": 5})
    with pytest.raises(Exception, match="1 series the run did not forecast"):
        model.predict(pd.DataFrame({"store": ["S999"], "item": ["I001"]}))

    answer = served_answer(
        "models:/retail/1", server, tmp_path,
        {"dataframe_split": asked.to_dict(orient="split"), "params": {"horizon": 2}},
    )  # fmt: skip
    served = pd.DataFrame(answer["predictions"])
    np.testing.assert_allclose(served["lo_95"], got["lo_95"])
    np.testing.assert_allclose(served["forecast"], got["forecast"])
    assert served[["store", "item"]].values.tolist() == got[["store", "item"]].values.tolist()


def test_a_registry_that_is_down_costs_one_line_and_keeps_the_checkpoint(tmp_path):
    down = f"http://127.0.0.1:{helpers.free_port()}"
    run_dir = tmp_path / "run"
    # MLflow's tracking (not what is tested here) would retry its dead server for minutes
    done = shardwise(
        "train", "examples/digits.toml", "--nproc", "1", "--set", f"job.run_dir={run_dir}",
        "--set", "train.steps=4", "--set", "checkpoint.every_steps=0", "--set",
        f"tracking.uri={down}", "--set", "tracking.log_model=true", "--set",
        "tracking.registered_model=digits", "--set", "tracking.report=false",
        env={"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"shardwise: MLflow at {down} did not answer"), last
    assert "is intact" in last and "Traceback" not in done.stderr
    checkpoint = final_checkpoint(run_dir)
    assert problem(str(checkpoint)) is None

    done = shardwise("export", str(checkpoint), "--mlflow", "digits", "--uri", down)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "did not answer" in done.stderr, done.stderr
    assert problem(str(checkpoint)) is None
