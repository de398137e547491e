"""Steady-state step time of `shardwise train` (DDP) against a hand-written torch DDP loop
(bench/baseline_ddp.py) on the same model, batch and thread settings; and samples/s of
shardwise on 1 and 2 processes at the same global batch.

Method (../shared/DESIGN.md, "Performance method"): every contender is a whole program started
the same way (torch's elastic agent), one torch thread per rank and OMP_NUM_THREADS=1. Each prints
a line every `log_every` steps; this script timestamps those lines as they arrive, and the
steady-state step time is (time of the last step's line - time of the line at the warm-up step) /
(steps between them). Start-up (launch to the first line) and the end (evaluation, checkpoint,
exit) fall outside the window and are reported separately. Contenders are interleaved and the
whole comparison repeated; medians and the min-max spread are printed.

    python bench/ddp_overhead.py                 # digits CNN and the byte-level GPT, 5 repeats
    python bench/ddp_overhead.py --jobs digits --repeats 3
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
JOBS = {
    # name: (job file, warm-up steps, total steps, extra --set overrides). The warm-up is long
    # enough that one-off start-up work (MLflow creating its store) ends inside it.
    "digits": ("examples/digits.toml", 500, 3000, ["train.global_batch=64"]),
    "gpt": ("examples/text-gpt.toml", 50, 250, ["train.global_batch=32", "train.precision=fp32"]),
}
COMMON = ["eval.every_steps=0", "checkpoint.every_steps=0", "tracking.log_every=25"]


def shardwise_cmd(nproc: int, *extra: str):
    def make(job: str, steps: int, run_dir: Path, sets: list[str]) -> list[str]:
        overrides = [*sets, *COMMON, *extra, f"train.steps={steps}", f"job.run_dir={run_dir}"]
        flags = [a for s in overrides for a in ("--set", s)]
        return [str(BIN / "shardwise"), "train", job, "--nproc", str(nproc), *flags]

    return make


def baseline_cmd(nproc: int):
    def make(job: str, steps: int, run_dir: Path, sets: list[str]) -> list[str]:
        del run_dir  # the baseline writes nothing
        script = str(REPO / "bench" / "baseline_ddp.py")
        flags = [a for s in [*sets, *COMMON] for a in ("--set", s)]
        return [
            str(BIN / "torchrun"),
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            script,
            "--job",
            job,
            "--steps",
            str(steps),
            *flags,
        ]

    return make


CONTENDERS = {
    "shardwise, 2 ranks": shardwise_cmd(2),
    "hand-written DDP, 2 ranks": baseline_cmd(2),
    "shardwise, 2 ranks, no MLflow": shardwise_cmd(2, "tracking.mlflow=false"),
    "shardwise, 1 process": shardwise_cmd(1),
}


STEP_LINE = re.compile(r"^step (\d+)")


def timed(cmd: list[str], warmup: int, steps: int) -> tuple[float, float]:
    """Run a contender; return (steady-state seconds per step, start-up seconds)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    began = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    assert proc.stdout is not None
    seen: dict[int, float] = {}
    for line in proc.stdout:
        match = STEP_LINE.match(line)
        if match:
            seen.setdefault(int(match.group(1)), time.monotonic())
    _, err = proc.communicate()
    if proc.returncode != 0 or warmup not in seen or steps not in seen:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{err[-3000:]}")
    return (seen[steps] - seen[warmup]) / (steps - warmup), min(seen.values()) - began


def measure(job: str, warmup: int, steps: int, sets: list[str], repeats: int):
    """Per contender: lists of steady-state seconds per step and of start-up seconds."""
    per_step: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    startup: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(repeats):
            for name, make in CONTENDERS.items():  # interleaved: A, B, C, A, B, C, ...
                run_dir = Path(tmp) / f"{name}-{repeat}".replace(" ", "_")
                step, start = timed(make(job, steps, run_dir, sets), warmup, steps)
                per_step[name].append(step)
                startup[name].append(start)
                print(f"  repeat {repeat + 1}: {name:<30} {step * 1e3:7.2f} ms/step", flush=True)
    return per_step, startup


def summarize(values: list[float]) -> str:
    low, high = min(values) * 1e3, max(values) * 1e3
    return f"{statistics.median(values) * 1e3:7.2f} ms  (spread {low:.2f}-{high:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", nargs="+", default=list(JOBS), choices=list(JOBS))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(
        f"{os.cpu_count()} cores; 1 torch thread per rank when 2 ranks share them, "
        "2 threads for 1 process; OMP_NUM_THREADS=1"
    )
    for name in args.jobs:
        job, warmup, steps, sets = JOBS[name]
        print(
            f"\n{name}: {job} {' '.join(sets)}, steps {warmup} to {steps}, {args.repeats} repeats"
        )
        per_step, startup = measure(job, warmup, steps, sets, args.repeats)
        report(name, args.repeats, sets, per_step, startup)


def report(name: str, repeats: int, sets: list[str], per_step: dict, startup: dict) -> None:
    print(f"\n{name} steady-state step time (median of {repeats})")
    for contender, values in per_step.items():
        start = statistics.median(startup[contender])
        print(f"  {contender:<30} {summarize(values)}   start-up {start:.1f} s")
    ratios = [
        a / b
        for a, b in zip(
            per_step["shardwise, 2 ranks"], per_step["hand-written DDP, 2 ranks"], strict=True
        )
    ]
    print(
        f"  ratio shardwise / hand-written DDP: median {statistics.median(ratios):.3f} "
        f"(spread {min(ratios):.3f}-{max(ratios):.3f}; target <= 1.03)"
    )
    tracking = [
        a / b
        for a, b in zip(
            per_step["shardwise, 2 ranks"], per_step["shardwise, 2 ranks, no MLflow"], strict=True
        )
    ]
    print(f"  ratio with / without MLflow: median {statistics.median(tracking):.3f}")
    batch = next(int(s.split("=")[1]) for s in sets if s.startswith("train.global_batch="))
    for contender in ("shardwise, 1 process", "shardwise, 2 ranks"):
        rate = batch / statistics.median(per_step[contender])
        print(f"  {contender:<30} {rate:,.0f} samples/s at global batch {batch}")


if __name__ == "__main__":
    main()
