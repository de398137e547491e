"""The `shardwise` command. It parses arguments and reports outcomes; the work happens elsewhere.

Exit codes: 0 done, 1 a worker failed (its rank and error are shown), 2 bad input (one line that
says what to fix; `--debug` shows the traceback), 128 + N stopped by signal N (130 for Ctrl-C).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from shardwise import __version__
from shardwise.common.arguments import add_debug, add_overrides
from shardwise.common.console import one_line_warnings
from shardwise.common.errors import ConfigError
from shardwise.common.redact import redacting_output


class Parser(argparse.ArgumentParser):
    """argparse, with a mistake on the command line said in one line like every other (exit 2),
    instead of the usage block and the error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"shardwise: error: {self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="shardwise", description="Distributed training for PyTorch.")
    parser.add_argument("--version", action="version", version=f"shardwise {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _train_arguments(commands.add_parser("train", help="train a model from a job file"))
    _many_models_arguments(
        commands.add_parser(
            "many-models",
            help="backtest, select and forecast a model per series, thousands at once",
        )
    )
    from shardwise.plan.plan_arguments import add_arguments as plan_arguments

    plan_arguments(
        commands.add_parser(
            "plan",
            help="which layout fits, how fast a step runs, how long the run takes",
            description="Plan a training run: memory per device and time per step for every "
            "layout, ranked; the whole run's time and the speedup over one device.",
        )
    )
    _export_arguments(
        commands.add_parser(
            "export",
            help="write a checkpoint's model as one safetensors file, or log it to MLflow's "
            "Model Registry, from any layout",
        )
    )
    from shardwise.training.launch.launch_arguments import add_arguments as launch_arguments

    launch_arguments(
        commands.add_parser(
            "launch",
            help="run a job file on a cluster: Slurm, Kubernetes (Kubeflow), Ray or Spark",
            description="Take the same job file to a cluster: slurm writes an sbatch script "
            "that starts one shardwise agent per node, resumes after preemption and requeues "
            "(--submit submits it); k8s prints a Kubeflow TrainJob or PyTorchJob with its "
            "ConfigMap (--apply creates them); ray and spark run the job's ranks as Ray actors "
            "or Spark barrier tasks from this process. --dry-run prints what would be "
            "submitted.",
        )
    )
    report = commands.add_parser(
        "report",
        help="write a training run's report: one HTML page with its charts",
        description="Loss and evaluation, throughput and MFU, memory per rank, pipeline "
        "bubble, where step time goes, and restarts, skipped steps and stragglers, from a "
        "run's own files (written at the end of every run too).",
    )
    report.add_argument("run_dir", help="the run's directory (job.run_dir)")
    report.add_argument("--out", help="where to write report.html and the PNGs (RUN_DIR/report)")
    add_debug(report)
    return parser


def _train_arguments(train: argparse.ArgumentParser) -> None:
    train.add_argument("job", help="the job's TOML file")
    train.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="worker processes on this machine (default 1; ignored under torchrun or srun)",
    )
    train.add_argument(
        "--nnodes",
        type=int,
        default=1,
        help="machines in the job: run the same command on each, with the same --rdzv-endpoint",
    )
    train.add_argument(
        "--rdzv-endpoint",
        metavar="HOST:PORT",
        help="with --nnodes: where the nodes meet (HOST is one of the nodes, which hosts it)",
    )
    train.add_argument(
        "--rdzv-id",
        metavar="ID",
        help="with --nnodes: the job's id on every node (default: job.name)",
    )
    train.add_argument(
        "--local-addr",
        metavar="ADDR",
        help="with --nnodes: this node's address as the others reach it (default: from its name)",
    )
    add_overrides(train, "train.lr=3e-4")
    train.add_argument(
        "--resume",
        default="never",
        metavar="auto|never|PATH",
        help="auto: continue from the newest complete checkpoint; PATH: from that checkpoint; "
        "never (default): refuse to overwrite an earlier run's checkpoints",
    )
    train.add_argument(
        "--dry-run",
        action="store_true",
        help="print the mesh, which blocks each rank holds and per-rank memory, without training",
    )
    add_debug(train)


def _many_models_arguments(many: argparse.ArgumentParser) -> None:
    many.add_argument("job", help="the job's TOML file")
    add_overrides(many, "data.num_series=10000")
    many.add_argument(
        "--resume", action="store_true", help="keep finished chunks, run only the others"
    )
    many.add_argument(
        "--features-backend", choices=("polars", "spark"), help="sets features.backend"
    )
    many.add_argument(
        "--spark-master", metavar="URL", help="sets features.spark_master (default local[*])"
    )
    many.add_argument(
        "--ray-address", metavar="ADDRESS", help="sets runner.ray_address ('auto': a cluster)"
    )
    many.add_argument(
        "--plot", action="store_true", help="draw plots of the forecasts (sets tracking.plots)"
    )
    add_debug(many)


def _export_arguments(export: argparse.ArgumentParser) -> None:
    export.add_argument(
        "checkpoint", help="a checkpoint directory or URL (…/checkpoints/step_NNNNNNNN)"
    )
    export.add_argument(
        "output", nargs="?", help="the .safetensors file to write (optional with --mlflow)"
    )
    export.add_argument(
        "--mlflow",
        metavar="NAME",
        help="log the model to MLflow as a pyfunc and register it as NAME's next version",
    )
    export.add_argument(
        "--uri",
        help="with --mlflow: the MLflow tracking and registry URI (default: MLFLOW_TRACKING_URI, "
        "else the job's tracking.uri or its run's store)",
    )
    add_debug(export)


def main(argv: Sequence[str] | None = None) -> int:
    # credentials in URIs never reach the console (redact.py); warnings are one line (console.py)
    with redacting_output(), one_line_warnings():
        return _run(build_parser().parse_args(argv))


def _run(args: argparse.Namespace) -> int:
    try:
        commands = {
            "train": _train,
            "export": _export,
            "many-models": _many_models,
            "plan": _plan,
            "report": _report,
            "launch": _launch,
        }
        return commands[args.command](args)
    except ConfigError as e:
        if args.debug:
            raise
        print(f"shardwise: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("shardwise: interrupted", file=sys.stderr)
        return 130


def _train(args: argparse.Namespace) -> int:
    from shardwise.training.launch.train_command import run

    return run(args)


def _many_models(args: argparse.Namespace) -> int:
    from shardwise.manymodel.config import load_many_models
    from shardwise.manymodel.run.placement import prestart

    flags = {
        "features.backend": args.features_backend,
        "features.spark_master": args.spark_master,
        "runner.ray_address": args.ray_address,
        "tracking.plots": True if args.plot else None,
    }
    overrides = [*args.overrides, *(f"{k}={v!r}" for k, v in flags.items() if v is not None)]
    config = load_many_models(args.job, overrides)
    prestart(config)  # the workers' imports overlap the runner's
    from shardwise.manymodel.run.runner import run

    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        summary = run(config, resume=args.resume)
    except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM via _terminated; Ray is stopped
        print(
            f"shardwise: stopped; finished chunks are kept in {config.run_dir / 'chunks'}, "
            "run again with --resume for the rest",
            file=sys.stderr,
        )
        return 128 + getattr(stop, "signum", signal.SIGINT)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0 if summary.completed or not summary.series else 1


class _Terminated(KeyboardInterrupt):
    signum = signal.SIGTERM


def _report(args: argparse.Namespace) -> int:
    from shardwise.training.tracking.run_report import write_report

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir} is not a directory; give a training run's job.run_dir")
    page = write_report(run_dir, Path(args.out) if args.out else None)
    print(f"report: {page}")
    return 0


def _terminated(signum: int, frame: object) -> None:
    raise _Terminated()


def _launch(args: argparse.Namespace) -> int:
    from shardwise.training.launch.launch_command import run

    try:
        return run(args)
    except RuntimeError as failure:  # Ray's or Spark's ranks, out of restarts
        from shardwise.training.launch.outcome import WorkerFailed
        from shardwise.training.launch.train_command import worker_failed

        if isinstance(failure, WorkerFailed) and not args.debug:
            return worker_failed(failure)
        raise


def _plan(args: argparse.Namespace) -> int:
    from shardwise.plan.plan_command import run

    return run(args)


def _export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from shardwise.training.checkpoint.export import export_safetensors

    if args.output is None and args.mlflow is None:
        raise ConfigError("export needs an OUTPUT file, --mlflow NAME, or both")
    if args.mlflow is not None and not args.mlflow.strip():
        raise ConfigError("--mlflow needs a model name (the registered model's)")
    if args.uri is not None and args.mlflow is None:
        raise ConfigError("--uri is where --mlflow NAME logs the model: add --mlflow NAME")
    if args.output is not None:
        written = export_safetensors(args.checkpoint, Path(args.output))
        print(
            f"wrote {args.output}: {written['tensors']} tensors, {written['parameters']:,} "
            f"parameters ({written['dtype']}, {written['bytes'] / 2**20:.1f} MiB) from step "
            f"{written['step']}"
        )
    if args.mlflow is not None:
        from shardwise.training.tracking.registered_model import log_checkpoint

        logged = log_checkpoint(args.checkpoint, name=args.mlflow, uri=args.uri)
        print(f"registered {logged.model_uri} (mlflow run {logged.run_id})")
    return 0


def entry() -> None:  # pragma: no cover - the console script
    owned_process()
    exit_without_teardown(main())


def exit_without_teardown(code: int) -> NoReturn:
    """End this process as the interpreter ends it, less its teardown: threads joined, exit
    handlers run (Ray's, Spark's, multiprocessing's, weakref finalizers, logging's), the streams
    flushed; then exit without freeing every object and module one by one, which a process about
    to end need not do (a tenth of a second and more after a job that imported polars, pyarrow
    and MLflow's client; mypy ends the same way)."""
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def owned_process() -> None:
    """This process is a `shardwise` command's own (the console script, `python -m shardwise`),
    not a caller's: its launcher may fork the ranks' server from itself (launch/forkserver/)."""
    from shardwise.training.launch.forkserver import fork_servers_from_this_process

    fork_servers_from_this_process()
