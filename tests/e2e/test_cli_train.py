"""`shardwise train` as a user runs it: the console script in a subprocess, real workers, a real
MLflow store."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

import helpers
from helpers import free_port, session_processes
from shardwise.training.tracking.metrics import read_metrics

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]


shardwise = helpers.shardwise_command


def test_digits_job_trains_tracks_and_resumes(tmp_path):
    run_dir = tmp_path / "digits"
    job = ["train", "examples/digits.toml", "--nproc", "2", "--set", f"job.run_dir={run_dir}"]
    temp = tmp_path / "tmp"  # the run's temporary files: none are left behind
    temp.mkdir()
    # the console script in a new interpreter, as the README's demo runs it (not forked from the
    # tests' server of commands, command_server.py)
    done = shardwise(*job, env={"TMPDIR": str(temp)}, fresh=True)
    assert done.returncode == 0, done.stderr
    cache = "torchinductor_"  # torch's compile cache, kept for every later run by design
    assert [p.name for p in temp.iterdir() if not p.name.startswith(cache)] == []
    assert "derived: world size 2" in done.stdout
    assert "Warning" not in done.stdout + done.stderr  # a clean run prints none
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["metrics"]["eval/accuracy"] >= 0.95
    assert summary["step"] == 300

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["train.steps"] == "300"
    assert run.data.params["derived.grad_accum"] == "1"
    assert len(client.get_metric_history(run.info.run_id, "loss")) == 300 // 25
    assert run.data.metrics["eval/accuracy"] >= 0.95
    assert "config.toml" in [a.path for a in client.list_artifacts(run.info.run_id)]
    assert (run_dir / "config.toml").read_text().count("[train]") == 1
    assert len([r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]) == 12
    assert "FLOPs per step (counted); peak" in done.stdout and "MFU" in done.stdout
    mfu = [r["mfu"] for r in read_metrics(run_dir / "metrics.jsonl") if "mfu" in r]
    assert len(mfu) == 12 and all(0 < m < 100 for m in mfu)
    assert len(client.get_metric_history(run.info.run_id, "tflops")) == 12

    again = shardwise(*job)
    assert again.returncode == 2
    assert "already holds checkpoints" in again.stderr and "--resume auto" in again.stderr
    assert "Traceback" not in again.stderr

    longer = shardwise(*job, "--resume", "auto", "--set", "train.steps=350")
    assert longer.returncode == 0, longer.stderr
    assert "resuming after step 300" in longer.stdout
    resumed = json.loads((run_dir / "summary.json").read_text())
    assert resumed["step"] == 350 and resumed["resumed_from"] == 300
    assert resumed["mlflow_run_id"] == summary["mlflow_run_id"]  # the same MLflow run continues
    history = client.get_metric_history(run.info.run_id, "loss")
    assert max(m.step for m in history) == 350


def test_under_torchrun_with_a_restart(tmp_path):
    """torchrun's own agent launches and restarts: shardwise joins, and after rank 1 is killed
    the restarted ranks agree to resume from the newest checkpoint."""
    done = subprocess.run(
        [
            *(
                str(BIN / "torchrun"),
                "--standalone",
                "--nproc-per-node",
                "2",
                "--max-restarts",
                "1",
                "--log-dir",  # torchrun's default: a new /tmp/torchelastic_* per run, kept
                str(tmp_path / "torchrun"),
            ),
            *("-m", "shardwise", "train", "examples/digits.toml"),
            *("--set", f"job.run_dir={tmp_path}", "--set", "train.steps=30"),
            *("--set", "eval.every_steps=0", "--set", "tracking.mlflow=false"),
            *("--set", "checkpoint.every_steps=10"),
        ],
        cwd=REPO,
        env={**os.environ, "SHARDWISE_FAULT": "kill:rank=1:step=15"},
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "summary.json").read_text())["step"] == 30
    restarts = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "fault/restarts" in r]
    assert [r["step"] for r in restarts] == [10]


def test_under_srun_environment(tmp_path):
    """Two tasks started the way srun starts them: SLURM_* variables, no torchrun."""
    port = free_port()
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "SLURM_STEP_NUM_TASKS": "2",
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank),
            "SLURM_STEP_NODELIST": "localhost",
            "SLURM_STEP_TASKS_PER_NODE": "2",
            "SLURM_JOB_ID": "1",
            "MASTER_PORT": str(port),
        }
        procs.append(
            subprocess.Popen(
                [
                    str(BIN / "shardwise"),
                    "train",
                    "examples/digits.toml",
                    "--set",
                    f"job.run_dir={tmp_path}",
                    "--set",
                    "train.steps=20",
                    "--set",
                    "tracking.mlflow=false",
                ],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                stdin=subprocess.DEVNULL,
            )
        )
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][1] + outputs[1][1]
    assert "world size 2" in outputs[0][0]
    assert json.loads((tmp_path / "summary.json").read_text())["step"] == 20


@pytest.mark.parametrize("slow_exit_s", [0, 3])
def test_a_failing_worker_is_named(tmp_path, slow_exit_s):
    """The rank whose own error ended the run is named, not a peer that failed because it left
    (gloo: "remote worker crashing"), even where that peer's process ended first: torch's agent
    then reports the peer alone."""
    done = shardwise(
        "train",
        "examples/digits.toml",
        "--nproc",
        "2",
        "--set",
        f"job.run_dir={tmp_path}",
        "--set",
        "model.name=tests.e2e.faulty:build_model",
        "--set",
        f"model.args={{slow_exit_s = {slow_exit_s}}}",
        "--set",
        "tracking.mlflow=false",
    )
    assert done.returncode == 1
    assert "shardwise: rank 1 failed (exit code 1): RuntimeError: injected failure in forward" in (
        done.stderr
    )
    assert "--- rank 1 traceback ---" in done.stderr and "faulty.py" in done.stderr


USER_PLAN = "parallel.tp_plan=examples.tabular:tp_plan"
SHORT_GPT = ["--set", "data.args.max_bytes=200000", "--set", "eval.max_samples=32"]


@pytest.mark.parametrize(
    ("job", "nproc", "extra"),
    [
        ("examples/text-gpt.toml", 2, ["--set", "train.steps=6", *SHORT_GPT]),
        ("examples/gpt-hybrid.toml", 4, ["--set", "train.steps=3", *SHORT_GPT]),
        ("examples/tabular.toml", 2, ["--set", "train.steps=40"]),
        (
            "examples/tabular.toml",
            2,
            ["--set", "train.steps=40", "--set", "parallel.tp=2", "--set", USER_PLAN],
        ),
        ("examples/tabular.toml", 2, ["--set", "train.steps=40", "--set", "parallel.pp=2"]),
        pytest.param(
            "examples/hf-gpt2.toml",
            2,
            ["--set", "train.steps=4", "--set", "eval.max_samples=32", "--set", "parallel.tp=2"],
            marks=pytest.mark.skipif(
                importlib.util.find_spec("transformers") is None,
                reason="transformers is not installed (pip install 'shardwise[hf]'; make does)",
            ),
        ),
    ],
    ids=["text-gpt", "gpt-hybrid", "tabular", "tabular-tp", "tabular-pp", "hf-gpt2-tp"],
)
def test_examples_run_as_written(tmp_path, job, nproc, extra):
    done = shardwise(
        "train",
        job,
        "--nproc",
        str(nproc),
        "--set",
        f"job.run_dir={tmp_path}",
        "--set",
        "tracking.mlflow=false",
        *extra,
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["metrics"]["eval/loss"] > 0
    assert len(summary["memory"]) == nproc


def test_live_replicas_of_a_pipeline_start_from_the_command(tmp_path):
    """`fault.mode = "live"` with a pipeline, as a user runs it: the checks before launch set
    TORCHINDUCTOR_CACHE_DIR, so the ranks' server starts again for the replicas; forked after
    the supervisor's store ran, its replicas could not read their arguments (Bad file
    descriptor) and the job died at once."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}  # a user's
    done = subprocess.run(
        [str(BIN / "shardwise"), "train", "examples/digits.toml", "--nproc", "4",
         "--set", f"job.run_dir={tmp_path}", "--set", "tracking.mlflow=false",
         "--set", "train.steps=6", "--set", "parallel.pp=2", "--set", "train.micro_batch=8",
         "--set", "fault.mode=live"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "done: step 6" in done.stdout
    # one replica's world, the step shared: not one replica accumulating the whole batch
    derived = next(line for line in done.stdout.splitlines() if line.startswith("derived:"))
    assert derived.startswith("derived: each live replica: world size 2, mesh pp=2"), derived
    assert (
        "global batch 64 shared among the replicas alive, in whole micro-batches (8 a step)"
        in derived
    )


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    """What examples/make_tables.py writes, as its docstring says to run it (into a temporary
    directory instead of runs/data)."""
    out = tmp_path_factory.mktemp("data")
    done = subprocess.run(
        [sys.executable, "examples/make_tables.py", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return out


@pytest.mark.parametrize(
    ("job", "paths", "extra"),
    [
        ("examples/gpt-parquet.toml", {"path": "tokens", "eval_path": "tokens-eval"},
         ["--set", "train.steps=4", "--set", "eval.max_samples=32"]),
        ("examples/digits-delta.toml",
         {"table": "digits-delta", "eval_table": "digits-delta-eval"}, ["--set", "train.steps=30"]),
    ],
    ids=["gpt-parquet", "digits-delta"],
)  # fmt: skip
def test_streaming_examples_run_as_written(tmp_path, tables, job, paths, extra):
    where = [
        arg for key, name in paths.items() for arg in ("--set", f"data.args.{key}={tables / name}")
    ]
    done = shardwise(
        "train", job, "--nproc", "2", "--set", f"job.run_dir={tmp_path}",
        "--set", "tracking.mlflow=false", *where, *extra,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "data: " in done.stdout and "leaving out" in done.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["metrics"]["eval/loss"] > 0 and len(summary["memory"]) == 2
    if "delta" in job:
        assert summary["metrics"]["eval/accuracy"] > 0.5
        assert "version = 1" in (tmp_path / "config.toml").read_text()


def test_a_streamed_job_dry_runs(tmp_path, tables):
    """--dry-run shapes the model by the table's first rows, as training does."""
    done = shardwise(
        "train", "examples/digits-delta.toml", "--nproc", "2", "--dry-run",
        "--set", f"job.run_dir={tmp_path}", "--set", f"data.args.table={tables / 'digits-delta'}",
        "--set", f"data.args.eval_table={tables / 'digits-delta-eval'}",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "params" in done.stdout and not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("data.args.inputs=picture", "has no column 'picture' (it has: image, label)"),
        ("data.args.version=9", "cannot load version 9"),
        ("train.global_batch=4096", "has 1438 samples, fewer than train.global_batch (4096)"),
    ],
    ids=["column", "version", "rows"],
)
def test_bad_streamed_data_is_one_line_before_launch(tmp_path, tables, change, message):
    done = shardwise(
        "train", "examples/digits-delta.toml", "--nproc", "2", "--set", f"job.run_dir={tmp_path}",
        "--set", f"data.args.table={tables / 'digits-delta'}",
        "--set", f"data.args.eval_table={tables / 'digits-delta-eval'}", "--set", change,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("shardwise: error: data: ") and message in done.stderr
    assert done.stderr.count("\n") == 1


def test_ctrl_c_stops_every_process(tmp_path):
    proc = subprocess.Popen(
        [
            str(BIN / "shardwise"),
            "train",
            "examples/digits.toml",
            "--nproc",
            "2",
            "--set",
            f"job.run_dir={tmp_path}",
            "--set",
            "train.steps=1000000",
            "--set",
            "tracking.log_every=10",
            "--set",
            "tracking.mlflow=false",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        for line in proc.stdout:
            if line.startswith("step "):
                break  # training is under way
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    assert "shardwise: stopped by SIGINT" in err
    assert "Traceback" not in err
    deadline = time.monotonic() + 10  # processes the launcher stopped may still be exiting
    while session_processes(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert session_processes(proc.pid) == []


@pytest.mark.parametrize(
    ("job", "extra", "shown"),
    [
        (
            "examples/digits.toml",  # the README's demo job: plain data parallelism (DDP)
            [],
            ["data-parallel wrapper: ddp", "layout: data parallel (DDP): every rank holds"],
        ),
        (
            "examples/text-gpt.toml",
            ["--set", "parallel.pp=2", "--set", "parallel.pipeline_schedule=Interleaved1F1B"],
            [
                "stage 0: embed … layers.0; stage 2: layers.2",
                "stage 1: layers.1; stage 3: layers.3 … final",
            ],
        ),
    ],
    ids=["ddp", "interleaved-pipeline"],
)
def test_dry_run_shows_the_layout_without_training(tmp_path, job, extra, shown):
    done = shardwise(
        "train", job, "--nproc", "2", "--dry-run", *extra, "--set", f"job.run_dir={tmp_path}/run"
    )
    assert done.returncode == 0, done.stderr
    assert "dry run: what each rank holds" in done.stdout
    for line in shown:
        assert line in done.stdout
    assert not (tmp_path / "run").exists()  # nothing trained, nothing written


def test_export_a_sharded_checkpoint_for_inference(tmp_path):
    from safetensors.torch import load_file

    from shardwise.models.gpt import build_gpt

    run_dir = tmp_path / "run"
    done = shardwise(
        "train",
        "examples/text-gpt.toml",
        "--nproc",
        "2",
        "--set",
        "parallel.tp=2",
        "--set",
        "train.steps=4",
        "--set",
        "eval.max_samples=16",
        "--set",
        "tracking.mlflow=false",
        "--set",
        f"job.run_dir={run_dir}",
    )
    assert done.returncode == 0, done.stderr
    out = tmp_path / "gpt.safetensors"
    exported = shardwise("export", str(run_dir / "checkpoints" / "step_00000004"), str(out))
    assert exported.returncode == 0, exported.stderr
    assert "from step 4" in exported.stdout and exported.stderr == ""
    model = build_gpt(layers=4, heads=4, hidden=128, seq_len=128)
    model.load_state_dict(load_file(out))  # strict: every name and shape matches the model
    bad = shardwise("export", str(run_dir), str(out))
    assert bad.returncode == 2 and "not a complete shardwise checkpoint" in bad.stderr
