"""Ranks forked from the launcher's server train on the GPU: two launches from one Python process
(the second reuses the server its first started), each a short `examples/gpt-parquet.toml` run on
`job.device = "cuda"`, and a resume of the first from its checkpoint. Prints each run's steps
and metrics, whether the server was reused, and a failed rank's traceback; exits 1 when a run
did not end where it should (a job on `cuda` refuses to start without a GPU). A check, not a
benchmark: run it on a GPU machine (bench/gpu_session.sh does), after
`python examples/make_tables.py --tables tokens`.

    python bench/gpu_forked_ranks.py RUN_DIR [--device cpu]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

import shardwise
from shardwise.training.launch import forkserver


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("run_dir")
    parser.add_argument("--device", default="cuda", help="cpu: the check's plumbing, on a CPU")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no GPU is visible: this check is for a GPU machine")
    common = [
        f"job.device={args.device}", "tracking.mlflow=false", "tracking.report=false",
        "train.steps=20", "eval.every_steps=10", "checkpoint.every_steps=10",
        "tracking.log_every=5",
    ]  # fmt: skip
    servers = []
    for launch in ("first", "second"):
        run_dir = os.path.join(args.run_dir, launch)
        summary = shardwise.train(
            "examples/gpt-parquet.toml", nproc=1, overrides=[*common, f"job.run_dir={run_dir}"]
        )
        assert summary is not None
        servers.append(forkserver._started_with)  # the same record: the server was reused
        print(f"{launch} launch: step {summary.step}, metrics {summary.metrics}", flush=True)
        if summary.step != 20 or not summary.memory or not summary.memory[0].get("peak"):
            print(f"{launch} launch did not train 20 steps: {summary}", flush=True)
            sys.exit(1)
    resumed = shardwise.train(
        "examples/gpt-parquet.toml",
        nproc=1,
        resume="auto",
        overrides=[*common, "train.steps=30", f"job.run_dir={os.path.join(args.run_dir, 'first')}"],
    )
    assert resumed is not None
    print(f"resumed from {resumed.resumed_from} to step {resumed.step}", flush=True)
    print(f"server reused: {servers[0] is servers[1]}; memory: {resumed.memory}", flush=True)
    if resumed.resumed_from != 20 or resumed.step != 30:
        sys.exit(1)


if __name__ == "__main__":
    try:
        main()
    except shardwise.WorkerFailed as e:  # where in the rank it failed, not its last line only
        print(f"{e}\n{e.traceback}", file=sys.stderr, flush=True)
        sys.exit(1)
