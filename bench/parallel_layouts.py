"""Throughput and per-rank memory of every parallel layout for the built-in GPT, against the
single-process run of the same job measured in the same run; and the pipeline bubble, measured
against the theoretical (p - 1) / (m + p - 1), for m = 2, 4 and 8 micro-batches.

Method (../shared/DESIGN.md, "Performance method"): each contender is `shardwise train` as a user
runs it, on the same model, data, global batch and optimizer; OMP_NUM_THREADS=1 and torch threads
= cores / local ranks for every contender. Throughput is the median samples/s over the logged
windows after the first (measured inside the run, so start-up does not count). Contenders are
interleaved and the whole set repeated; medians and spreads are printed. Four ranks on this 2-core
machine share the cores two to a core, so their throughput shows the cost of oversubscription as
much as the layout; their memory figures are what matters.

    python bench/parallel_layouts.py                  # about 25 minutes on 2 cores
    python bench/parallel_layouts.py --repeats 1 --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
MODEL = ["model.args.layers=8", "model.args.heads=8", "model.args.hidden=256"]
COMMON = [
    *MODEL,
    "data.args.max_bytes=2000000",
    "train.global_batch=16",
    "train.micro_batch=2",
    "train.precision=fp32",
    "eval.every_steps=0",
    "eval.max_samples=16",
    "tracking.mlflow=false",
]
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "1 process (baseline)": (1, []),
    "DDP 2": (2, []),
    "FSDP ZeRO-2, 2": (2, ["parallel.dp_shard=2", "parallel.reshard_after_forward=false"]),
    "FSDP ZeRO-3, 2": (2, ["parallel.dp_shard=2"]),
    "FSDP ZeRO-3 + full recompute, 2": (
        2,
        ["parallel.dp_shard=2", "parallel.activation_checkpoint=full"],
    ),
    "TP 2": (2, ["parallel.tp=2"]),
    "TP 2 + sequence parallel": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "PP 2 GPipe": (2, ["parallel.pp=2", "parallel.pipeline_schedule=GPipe"]),
    "PP 2 1F1B": (2, ["parallel.pp=2", "parallel.pipeline_schedule=1F1B"]),
    "PP 2 Interleaved1F1B": (2, ["parallel.pp=2", "parallel.pipeline_schedule=Interleaved1F1B"]),
    "PP 2 ZBVZeroBubble": (2, ["parallel.pp=2", "parallel.pipeline_schedule=ZBVZeroBubble"]),
    "HSDP 2x2 (4 ranks)": (4, ["parallel.dp_replicate=2", "parallel.dp_shard=2"]),
    "DP 2 x TP 2 (4 ranks)": (4, ["parallel.dp_replicate=2", "parallel.tp=2"]),
    "DP 2 x PP 2 (4 ranks)": (4, ["parallel.dp_replicate=2", "parallel.pp=2"]),
    "PP 2 x TP 2 (4 ranks)": (4, ["parallel.pp=2", "parallel.tp=2"]),
}


def run(nproc: int, sets: list[str], steps: int, run_dir: Path) -> dict[str, Any]:
    overrides = [*COMMON, *sets, f"train.steps={steps}", "tracking.log_every=5"]
    overrides.append(f"job.run_dir={run_dir}")
    cmd = [str(BIN / "shardwise"), "train", "examples/text-gpt.toml", "--nproc", str(nproc)]
    cmd += [a for s in overrides for a in ("--set", s)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL
    )
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    summary: dict[str, Any] = json.loads((run_dir / "summary.json").read_text())
    return summary


def mib(value: float) -> str:
    return f"{value / 2**20:8.1f}"


def layouts(repeats: int, steps: int, tmp: Path) -> None:
    rates: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    memory: dict[str, list[dict[str, Any]]] = {}
    for repeat in range(repeats):
        for name, (nproc, sets) in LAYOUTS.items():  # interleaved: A, B, C, …, A, B, C, …
            run_dir = tmp / f"{len(rates[name])}-{repeat}-{abs(hash(name))}"
            summary = run(nproc, sets, steps, run_dir)
            rates[name].append(summary["samples_per_second"])
            memory[name] = summary["memory"]
            print(f"  repeat {repeat + 1}: {name:<34} {rates[name][-1]:7.1f} samples/s", flush=True)
    base = statistics.median(rates["1 process (baseline)"])
    print(f"\nGPT {' '.join(MODEL)}, global batch 16, micro batch 2, fp32, median of {repeats}")
    print(
        f"  {'layout':<34} {'samples/s':>9} {'vs 1 proc':>9}   per rank (MiB, largest rank): "
        f"{'params':>8} {'grads':>8} {'optim':>8} {'peak RSS':>8}"
    )
    for name, values in rates.items():
        top = max(memory[name], key=lambda r: r["params"])
        median = statistics.median(values)
        spread = f"({min(values):.1f}-{max(values):.1f})"
        print(
            f"  {name:<34} {median:9.1f} {median / base:8.2f}x   {spread:<26} "
            f"{mib(top['params'])} {mib(top['grads'])} {mib(top['optimizer'])} {mib(top['peak'])}"
        )


def bubbles(repeats: int, steps: int, tmp: Path) -> None:
    print("\npipeline bubble, pp = 2 (idle fraction of step time on each rank, mean over ranks)")
    print(f"  {'schedule':<10} {'m':>3} {'measured':>9} {'theory':>8}")
    for schedule in ("GPipe", "1F1B"):
        for m in (2, 4, 8):
            measured, theory = [], 0.0
            for repeat in range(repeats):
                sets = [
                    "parallel.pp=2",
                    f"parallel.pipeline_schedule={schedule}",
                    f"train.global_batch={2 * m}",
                ]
                summary = run(2, sets, steps, tmp / f"bubble-{schedule}-{m}-{repeat}")
                measured.append(statistics.mean(r["bubble"] for r in summary["memory"]))
                theory = summary["memory"][0]["bubble_theory"]
            print(
                f"  {schedule:<10} {m:>3} {statistics.median(measured):9.1%} {theory:8.1%}",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--only", choices=["layouts", "bubble"], default=None)
    args = parser.parse_args()
    print(f"{os.cpu_count()} cores; OMP_NUM_THREADS=1; torch threads = cores / local ranks")
    with tempfile.TemporaryDirectory() as tmp:
        if args.only in (None, "layouts"):
            layouts(args.repeats, args.steps, Path(tmp))
        if args.only in (None, "bubble"):
            bubbles(args.repeats, args.steps, Path(tmp))


if __name__ == "__main__":
    main()
