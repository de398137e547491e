"""Start-up to the first step, and recovery from a killed worker, for each launcher on this
machine: the elastic agent (`shardwise train --nproc 2`), Ray (`shardwise launch ray`, a local
Ray started by the command, two actors) and Spark (`shardwise launch spark`, local-cluster mode,
two executors). The same job in each (the GPT of examples/text-gpt.toml, 2 ranks, one thread
each, a checkpoint every 10 steps), in the same run.

- start-up: from starting the command to the first trained step's record in metrics.jsonl;
- recovery: rank 1 SIGKILLs itself right after step 25 (SHARDWISE_FAULT); from that step's
  record to the first step trained after the restart (which resumes from step 20).

    python bench/launchers.py                 # about 15 minutes per repeat on 2 cores
    python bench/launchers.py --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
KILL_STEP = 25
JOB = [
    "train.steps=40",
    "checkpoint.every_steps=10",
    "tracking.mlflow=false",
    "tracking.report=false",
    "tracking.log_every=1",
    "eval.every_steps=0",
    "eval.max_samples=16",
    "fault.max_restarts=1",
    "job.threads_per_rank=1",
]
LAUNCHERS = {
    "elastic agent": ["train", "examples/text-gpt.toml", "--nproc", "2"],
    "Ray actors": ["launch", "ray", "examples/text-gpt.toml", "--nproc-per-node", "2"],
    "Spark barrier tasks": [
        "launch", "spark", "examples/text-gpt.toml", "--nodes", "2", "--nproc-per-node", "1",
        "--shared-storage",
    ],
}  # fmt: skip


def run(command: list[str], run_dir: Path, fault: str | None) -> tuple[float, list[dict]]:
    """When the command started (epoch seconds), and its metrics records."""
    overrides = [arg for item in [*JOB, f"job.run_dir={run_dir}"] for arg in ("--set", item)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if fault:
        env["SHARDWISE_FAULT"] = fault
    started = time.time()
    done = subprocess.run(
        [str(BIN / "shardwise"), *command, *overrides],
        cwd=REPO, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return started, [json.loads(line) for line in lines]


def startup(started: float, records: list[dict]) -> float:
    return next(r["time"] for r in records if "loss" in r) - started


def recovery(records: list[dict]) -> float:
    killed = next(r["time"] for r in records if r.get("step") == KILL_STEP and "loss" in r)
    resume = next(i for i, r in enumerate(records) if r.get("event") == "resume")
    return next(r["time"] for r in records[resume:] if "loss" in r) - killed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    starts: dict[str, list[float]] = {name: [] for name in LAUNCHERS}
    recoveries: dict[str, list[float]] = {name: [] for name in LAUNCHERS}
    with tempfile.TemporaryDirectory(prefix="shardwise-bench-") as tmp:
        for repeat in range(args.repeats):
            for i, (name, command) in enumerate(LAUNCHERS.items()):
                started, records = run(command, Path(tmp) / f"clean-{repeat}-{i}", None)
                starts[name].append(startup(started, records))
                _, records = run(
                    command, Path(tmp) / f"kill-{repeat}-{i}", f"kill:rank=1:step={KILL_STEP}"
                )
                recoveries[name].append(recovery(records))
                print(
                    f"  repeat {repeat + 1}: {name:<20} start-up {starts[name][-1]:5.1f} s, "
                    f"recovery {recoveries[name][-1]:5.1f} s",
                    flush=True,
                )
    base_start = statistics.median(starts["elastic agent"])
    base_recovery = statistics.median(recoveries["elastic agent"])
    print(f"\n  {'launcher':<20} {'start-up s':>10} {'ratio':>6}   {'recovery s':>10} {'ratio':>6}")
    for name in LAUNCHERS:
        start, back = statistics.median(starts[name]), statistics.median(recoveries[name])
        print(
            f"  {name:<20} {start:10.1f} {start / base_start:6.2f}   "
            f"{back:10.1f} {back / base_recovery:6.2f}"
        )
    print("  (medians; ratios against the elastic agent, measured in the same run)")


if __name__ == "__main__":
    main()
