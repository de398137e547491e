"""`shardwise launch slurm`: the sbatch script it writes, and the checks before anything is
submitted (one line, exit 2). The script running on a real Slurm: tests/e2e/test_launch_slurm.py."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import tomli_w

from helpers import digits_job
from shardwise.cli import main
from shardwise.common.errors import ConfigError
from shardwise.training.launch.targets import filesystem_type, unshared


@pytest.fixture
def job(tmp_path: Path) -> Path:
    path = tmp_path / "job.toml"
    config = digits_job(tmp_path / "run")
    path.write_text(tomli_w.dumps(config.model_dump(mode="json", exclude_none=True)))
    return path


def launch(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["launch", "slurm", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_dry_run_prints_the_script_and_writes_nothing(job, capsys, tmp_path):
    code, out, _ = launch(
        capsys, str(job), "--nodes", "2", "--nproc-per-node", "2", "--time", "04:00:00",
        "--partition", "cpu", "--account", "ml", "--sbatch", "qos=high",
        "--sbatch=--constraint=fast", "--cpus-per-node", "8", "--shared-storage",
        "--set", "train.lr=0.05", "--dry-run",
    )  # fmt: skip
    assert code == 0
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --cpus-per-task=8",
        "#SBATCH --time=04:00:00",
        "#SBATCH --partition=cpu",
        "#SBATCH --account=ml",
        "#SBATCH --requeue",
        "#SBATCH --signal=B:TERM@120",
        "#SBATCH --qos=high",
        "#SBATCH --constraint=fast",
        f"#SBATCH --output={tmp_path / 'run'}/launch/slurm-%j.out",
    ):
        assert line + "\n" in out
    srun = next(line for line in out.splitlines() if line.startswith("srun "))
    assert f"train {job} --nproc 2 --nnodes 2 --resume auto --set train.lr=0.05" in srun
    assert '--rdzv-endpoint "$addr:$port"' in srun
    assert "scontrol requeue" in out and "--gpus-per-node" not in out
    assert not (tmp_path / "run").exists()


def test_one_node_needs_no_rendezvous_and_gpus_are_asked_for(job, capsys, tmp_path):
    code, out, _ = launch(capsys, str(job), "--gpus-per-node", "4", "--dry-run")
    assert code == 0
    assert "#SBATCH --gpus-per-node=4\n" in out and "--nproc 4 --resume auto" in out
    assert "--nnodes" not in out and "rdzv" not in out


def test_without_dry_run_the_script_is_written_and_runnable(job, capsys, tmp_path):
    code, out, _ = launch(capsys, str(job))
    script = tmp_path / "run" / "launch" / "slurm.sbatch"
    assert code == 0 and out.strip() == f"wrote {script}; submit it with: sbatch {script}"
    assert script.read_text().startswith("#!/bin/bash\n")
    assert script.stat().st_mode & stat.S_IXUSR


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--nodes", "2"],
            "checkpoint.dir = '{run}/checkpoints': on this machine's own disk (",
        ),
        (["--set", "parallel.tp=4"], "--nodes 1 × 1 ranks per node: "),
        (["--gpus-per-node", "2", "--set", "job.device=cpu"], "--gpus-per-node 2 with job."),
        (["--set", "job.device=cuda"], "job.device = 'cuda' but no GPUs were asked for"),
        (["--sbatch", "=high"], "--sbatch '=high': expected one sbatch option"),
        (["--nodes", "0"], "--nodes 0: need at least 1"),
        (["--port", "70000"], "--port 70000: a port is 1–65535"),
        (["--signal-seconds", "2"], "--signal-seconds 2: give the ranks at least 10 s"),
    ],
)
def test_bad_launches_are_one_line_before_anything_is_written(job, capsys, tmp_path, args, message):
    code, out, err = launch(capsys, str(job), *args)
    assert code == 2 and not out
    assert err.startswith("shardwise: error: " + message.format(run=tmp_path / "run")), err
    assert err.count("\n") == 1
    assert not (tmp_path / "run").exists()


def test_object_stores_and_network_filesystems_count_as_shared(tmp_path):
    assert unshared("s3://bucket/checkpoints", 4) is None
    assert unshared(str(tmp_path), 1) is None
    assert unshared(str(tmp_path / "not" / "yet"), 2) is not None
    assert filesystem_type(Path("/proc/self")) == "proc"
    assert filesystem_type(tmp_path / "not" / "yet") == filesystem_type(tmp_path)


@pytest.mark.parametrize(
    ("target", "lines"),
    [
        ("ray", ["placement group: 2 bundles of {'CPU': 1.0}, strategy SPREAD", "2 × shardwise"]),
        ("spark", ["on local-cluster[2,1,2048]", "TorchDistributor(num_processes=2"]),
    ],
)
def test_ray_and_spark_dry_runs_say_what_would_run_and_start_nothing(
    job, capsys, tmp_path, target, lines
):
    args = ["--nodes", "2", "--shared-storage", "--dry-run"]
    code = main(
        ["launch", target, str(job), *args, *(["--placement", "spread"] * (target == "ray"))]
    )
    out = capsys.readouterr().out
    assert code == 0 and all(line in out for line in lines), out
    assert not (tmp_path / "run").exists()


def test_restarts_number_the_attempts_and_a_config_error_is_not_retried(capsys):
    """Ray and Spark run their ranks again through one loop: attempts are numbered from 0, each
    failure but the last says what runs again, and a ConfigError (a bad job) stops at once."""
    from shardwise.training.launch.targets import run_with_restarts

    seen: list[int] = []

    def fails_twice_then_succeeds(n: int) -> str:
        seen.append(n)
        if n < 2:
            raise RuntimeError(f"rank 1 died in attempt {n}")
        return "done"

    again = lambda failure: f"{failure}; again"  # noqa: E731
    assert run_with_restarts(2, fails_twice_then_succeeds, again=again, fatal=lambda f: f) == "done"
    assert seen == [0, 1, 2]
    out = capsys.readouterr().out
    assert "rank 1 died in attempt 0; again (1 of 2) from the newest good checkpoint" in out
    assert "(2 of 2)" in out

    seen.clear()
    with pytest.raises(ValueError, match="gave up: rank 1 died in attempt 1"):
        run_with_restarts(
            1, fails_twice_then_succeeds, again=again, fatal=lambda f: ValueError(f"gave up: {f}")
        )
    assert seen == [0, 1]

    def bad_job(n: int) -> str:
        seen.append(n)
        raise ConfigError("parallel.tp = 3 does not divide the 2 ranks")

    seen.clear()
    with pytest.raises(ConfigError):
        run_with_restarts(3, bad_job, again=again, fatal=lambda f: f)
    assert seen == [0]


def test_a_failed_spark_stage_names_the_rank_whose_task_failed():
    """Spark's error (py4j's, as a real local-cluster run raised it) names the failed barrier
    task as ResultTask(stage, partition); the partition is the rank."""
    from shardwise.training.launch.outcome import WorkerFailed
    from shardwise.training.launch.spark_tasks import _stage_failed

    spark = (
        "An error occurred while calling o58.collectToPython.\n: org.apache.spark.SparkException: "
        "Job aborted due to stage failure: Could not recover from a failed barrier ResultStage. "
        "Most recent failure reason: Stage failed because barrier task ResultTask(0, 1) finished "
        "unsuccessfully.\norg.apache.spark.api.python.PythonException: [PYTHON_EXCEPTION] …"
    )
    failed = _stage_failed(RuntimeError(spark))
    assert isinstance(failed, WorkerFailed) and failed.rank == 1
    assert str(failed) == (
        "rank 1 failed (exit code 1): the Spark stage failed: Stage failed because barrier task "
        "ResultTask(0, 1) finished unsuccessfully. (the ranks' output is above)"
    )
    assert _stage_failed(RuntimeError("Python worker exited")).rank == 0  # no task named
    bad = ConfigError("bad job")
    assert _stage_failed(bad) is bad


STUBS = {
    # the job's step: runs until it is signalled (as the ranks stop once they have saved)
    "srun": 'echo $$ > "$STUBS/srun.pid"; trap "exit 143" TERM; while :; do sleep 0.05; done',
    # the forwarder's scancel signals the step, as Slurm would
    "scancel": 'echo "scancel $*" >> "$STUBS/calls"; kill -TERM "$(cat "$STUBS/srun.pid")"',
    # Slurm sends the batch shell SIGTERM when it requeues the running job
    "scontrol": 'echo "scontrol $*" >> "$STUBS/calls"; kill -TERM "$PPID"; sleep 0.3',
}


def test_the_scripts_requeue_starts_no_forwarder_that_would_signal_the_next_attempt(
    job, capsys, tmp_path
):
    """Slurm's warning (SIGTERM to the batch shell) is forwarded to the step once; the script's
    own `scontrol requeue` brings Slurm's SIGTERM again, after the step has ended. A forwarder
    started then outlived the script, and under load its retries reached the next attempt's
    step (the Slurm time-limit test's second attempt was cancelled at its start). Slurm's
    commands here are stand-ins that record their calls; the script is the one written."""
    import os
    import signal
    import subprocess
    import time

    assert launch(capsys, str(job))[0] == 0
    script = tmp_path / "run" / "launch" / "slurm.sbatch"
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    for name, body in STUBS.items():
        (stubs / name).write_text(f"#!/bin/bash\n{body}\n")
        (stubs / name).chmod(0o755)
    env = {**os.environ, "STUBS": str(stubs), "PATH": f"{stubs}:{os.environ['PATH']}",
           "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1"}  # fmt: skip
    shell = subprocess.Popen(["bash", str(script)], env=env, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 10
    while not (stubs / "srun.pid").exists():
        assert time.monotonic() < deadline, "the step did not start"
        time.sleep(0.05)
    shell.send_signal(signal.SIGTERM)  # Slurm's warning before the time limit
    out, _ = shell.communicate(timeout=10)
    assert shell.returncode == 0 and "requeueing job 7" in out, out
    time.sleep(0.5)  # what a forwarder started at the end would have recorded by now
    calls = (stubs / "calls").read_text().splitlines()
    assert calls == ["scancel --signal=TERM 7", "scontrol requeue 7"], calls
