"""The CLI as a user meets it, for the cases that end before any worker starts."""

import pytest

from shardwise.cli import build_parser, main


def test_cli_flags_are_pinned():
    """Adding a flag is a decision: change this test with it."""
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    assert sorted(commands) == ["export", "launch", "many-models", "plan", "report", "train"]
    flags = sorted(o for a in commands["train"]._actions for o in a.option_strings)
    assert flags == sorted(
        [
            *("-h", "--help", "--nproc", "--set", "--resume", "--dry-run", "--debug"),
            *("--nnodes", "--rdzv-endpoint", "--rdzv-id", "--local-addr"),
        ]
    )
    flags = sorted(o for a in commands["export"]._actions for o in a.option_strings)
    assert flags == sorted(["-h", "--help", "--debug", "--mlflow", "--uri"])
    flags = sorted(o for a in commands["report"]._actions for o in a.option_strings)
    assert flags == sorted(["-h", "--help", "--out", "--debug"])
    flags = sorted(o for a in commands["many-models"]._actions for o in a.option_strings)
    assert flags == sorted(
        [
            "-h",
            "--help",
            "--set",
            "--resume",
            "--features-backend",
            "--spark-master",
            "--ray-address",
            "--plot",
            "--debug",
        ]
    )
    flags = sorted(o for a in commands["launch"]._actions for o in a.option_strings)
    assert flags == sorted(
        [
            *("-h", "--help", "--nodes", "--gpus-per-node", "--nproc-per-node", "--set"),
            *("--shared-storage", "--dry-run", "--submit", "--apply", "--debug"),
            *("--image", "--namespace", "--api", "--memory-per-node", "--volume"),
            *("--max-restarts", "--ray-address", "--placement", "--cpus-per-rank", "--resume"),
            *("--spark-master", "--time", "--partition", "--account", "--cpus-per-node"),
            *("--sbatch", "--port", "--signal-seconds"),
        ]
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "train.stpes=5"], "did you mean 'train.steps'?"),
        (["--set", "train.steps=abc"], "train.steps: input should be a valid integer"),
        (
            ["--nproc", "3"],
            "must be a multiple of train.micro_batch (32) × data-parallel ranks (3)",
        ),
        (["--set", "model.name=nowhere.mod:build"], "cannot import module 'nowhere'"),
        (["--set", "model.args.chanels=8"], "did you mean 'model.args.channels'?"),
        (["--set", "parallel.tp=2", "--nproc", "2"], "has none (no tp_plan() method)"),
        (
            [
                "--nproc",
                "2",
                "--set",
                "parallel.pp=2",
                "--set",
                "parallel.pipeline_schedule=DualPipeV",
            ],
            "DualPipeV needs at least as many micro-batches as stages (4), got 2",
        ),
        (["--nproc", "0"], "--nproc 0: need at least 1 process"),
        (["--resume", "/no/such/checkpoint"], "not a complete checkpoint"),
        (["--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
        (["--nnodes", "2", "--rdzv-endpoint", "10.0.0.1"], "needs --rdzv-endpoint HOST:PORT"),
        (["--rdzv-endpoint", "10.0.0.1:29400"], "--rdzv-endpoint is for jobs across machines"),
        (["--nnodes", "0"], "--nnodes 0: need at least 1 node"),
        (
            ["--nnodes", "2", "--rdzv-endpoint", "no-such-host.invalid:29400"],
            "--rdzv-endpoint no-such-host.invalid: the host name does not resolve",
        ),
        (["--nnodes", "2", "--rdzv-endpoint", "10.0.0.1:70000"], "a port from 1 to 65535"),
        (
            ["--set", "tracking.log_model=true", "--set", "tracking.mlflow=false"],
            "tracking.log_model = true logs the model to MLflow, which tracking.mlflow = false",
        ),
        (
            ["--set", "tracking.registered_model=digits"],
            "registers the logged model: set tracking.log_model = true too",
        ),
        (
            ["--set", 'checkpoint.dir="nosuch://bucket/run"'],
            "checkpoint.dir = 'nosuch://bucket/run': cannot write there (ValueError: Protocol "
            "not known: nosuch)",
        ),
    ],
)
def test_bad_input_exits_2_with_one_line(repo_cwd, tmp_path, capsys, args, message):
    code = main(["train", "examples/digits.toml", "--set", f"job.run_dir={tmp_path}", *args])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("shardwise: error: ") and err.count("\n") == 1
    assert message in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "export needs an OUTPUT file, --mlflow NAME, or both"),
        (["out.safetensors", "--uri", "http://127.0.0.1:1"], "--uri is where --mlflow NAME"),
        (["--mlflow", " "], "--mlflow needs a model name"),
        (["--mlflow", "m"], "is not a complete shardwise checkpoint"),
    ],
)
def test_bad_export_exits_2_with_one_line(tmp_path, capsys, args, message):
    assert main(["export", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardwise: error: ") and err.count("\n") == 1
    assert message in err


def test_missing_job_file(capsys, tmp_path):
    assert main(["train", str(tmp_path / "missing.toml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_debug_shows_the_traceback(repo_cwd):
    from shardwise.common.errors import ConfigError

    with pytest.raises(ConfigError):
        main(["train", "examples/digits.toml", "--set", "train.stpes=1", "--debug"])


INTERLEAVED = "parallel.pipeline_schedule=Interleaved1F1B"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nproc", "3", "--set", "parallel.tp=3"], "does not divide the 4 attention heads"),
        (
            ["--nproc", "4", "--set", "parallel.pp=4", "--set", INTERLEAVED],
            "8 pipeline stages, but the model has only 6 blocks",
        ),
        (["--nproc", "2", "--set", "parallel.tp=4"], "does not divide the world size 2"),
        (
            ["--nproc", "2", "--set", "parallel.pp=2", "--set", "train.micro_batch=32"],
            "1F1B needs at least as many micro-batches as stages (2), got 1",
        ),
    ],
)
def test_impossible_layouts_exit_2_before_launch(repo_cwd, tmp_path, capsys, args, message):
    code = main(["train", "examples/text-gpt.toml", "--set", f"job.run_dir={tmp_path}", *args])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("shardwise: error: ") and err.count("\n") == 1
    assert message in err


@pytest.mark.parametrize("command", ["train", "many-models", "plan", "export", "launch", "report"])
def test_every_commands_help_prints(command, capsys):
    """`shardwise launch --help` raised ValueError: a '%' in a help text is a format character
    to argparse."""
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: shardwise {command}") and "--debug" in out


def test_the_command_ends_as_the_interpreter_would_less_its_teardown(tmp_path):
    """`exit_without_teardown` (how the console script ends): non-daemon threads finish, exit
    handlers run, buffered output is written, and the exit code is the command's; only the
    interpreter's freeing of every object is skipped."""
    import subprocess
    import sys

    script = f"""
import atexit, threading, time
from pathlib import Path
from shardwise.cli import exit_without_teardown
here = Path({str(tmp_path)!r})
atexit.register(lambda: (here / "handler").write_text("ran"))
def late():
    time.sleep(0.3)
    (here / "thread").write_text("finished")
threading.Thread(target=late).start()
print("buffered, never flushed by hand", end="")
exit_without_teardown(3)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 3, done.stderr
    assert done.stdout == "buffered, never flushed by hand"
    assert (tmp_path / "handler").read_text() == "ran"
    assert (tmp_path / "thread").read_text() == "finished"
