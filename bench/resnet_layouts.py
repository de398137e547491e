"""ResNet-18 (or -50) on real images: pure data parallelism against pipeline parallelism and
data × pipeline, on the same global batch, each against one process measured in the same run:
training throughput, speedup over one process, the measured pipeline bubble beside the theory,
and utilisation (MFU against the matrix-multiply peak each run measures at its start).

The images are scikit-learn's digits upsampled to 3×32×32 (examples/resnet.toml), so nothing is
downloaded. Method (../shared/DESIGN.md, "Performance method"): each contender is
`shardwise train examples/resnet.toml` as a user runs it, OMP_NUM_THREADS=1 and torch threads =
cores / local ranks; throughput is the median samples/s over the logged windows after the first
(start-up and the first step's allocations are outside it); MFU the median over the same
windows. Contenders are interleaved and the whole set repeated; medians and min-max spreads are
printed. On a 2-core machine the 4-rank contender puts two ranks on each core, so its figure
shows the cost of oversubscription as much as the layout's.

    python bench/resnet_layouts.py                    # ResNet-18, 3 repeats, about 10 minutes
    python bench/resnet_layouts.py --depth 50 --repeats 1
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
GLOBAL_BATCH, MICRO_BATCH = 32, 4
COMMON = [
    f"train.global_batch={GLOBAL_BATCH}",
    f"train.micro_batch={MICRO_BATCH}",
    "eval.every_steps=0",
    "checkpoint.every_steps=0",
    "tracking.mlflow=false",
    "tracking.log_every=3",
]
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "1 process (baseline)": (1, []),
    "data parallel 2 (DDP)": (2, []),
    "pipeline 2 (1F1B)": (2, ["parallel.pp=2", "parallel.pipeline_schedule=1F1B"]),
    "pipeline 2 (GPipe)": (2, ["parallel.pp=2", "parallel.pipeline_schedule=GPipe"]),
    # ResNet's parameters sit in its late stages, its compute in the early ones (at full
    # resolution): an equal-parameter split leaves stage 0 doing most of the work
    "pipeline 2 (1F1B), split by cost": (
        2,
        ["parallel.pp=2", "parallel.pipeline_schedule=1F1B", "parallel.pipeline_balance=cost"],
    ),
    "data 2 x pipeline 2 (4 ranks)": (4, ["parallel.dp_replicate=2", "parallel.pp=2"]),
}


def run(nproc: int, sets: list[str], steps: int, run_dir: Path) -> dict[str, Any]:
    """One contender's figures: samples/s, MFU (medians over the windows after the first) and
    the measured and theoretical bubble (means over ranks; none without a pipeline)."""
    overrides = [*COMMON, *sets, f"train.steps={steps}", f"job.run_dir={run_dir}"]
    cmd = [str(BIN / "shardwise"), "train", "examples/resnet.toml", "--nproc", str(nproc)]
    cmd += [a for s in overrides for a in ("--set", s)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL
    )
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    windows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    mfu = [w["mfu"] for w in windows if "mfu" in w][1:]
    ranks = summary["memory"]
    piped = "bubble" in ranks[0]
    return {
        "rate": summary["samples_per_second"],
        "mfu": statistics.median(mfu) if mfu else float("nan"),
        "bubble": statistics.mean(r["bubble"] for r in ranks) if piped else None,
        "theory": ranks[0]["bubble_theory"] if piped else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depth", type=int, choices=[18, 50], default=18)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    model = [f"model.args.depth={args.depth}"]
    print(f"{os.cpu_count()} cores; OMP_NUM_THREADS=1; torch threads = cores / local ranks")
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in LAYOUTS}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for name, (nproc, sets) in LAYOUTS.items():  # interleaved: A, B, C, …, A, B, C, …
                run_dir = Path(tmp) / f"{repeat}-{abs(hash(name))}"
                results[name].append(run(nproc, [*model, *sets], args.steps, run_dir))
                got = results[name][-1]
                print(f"  repeat {repeat + 1}: {name:<34} {got['rate']:6.1f} samples/s", flush=True)
    base = statistics.median(r["rate"] for r in results["1 process (baseline)"])
    print(
        f"\nResNet-{args.depth} on digits at 3x32x32, global batch {GLOBAL_BATCH}, micro batch "
        f"{MICRO_BATCH}, fp32, {args.steps} steps, median of {args.repeats}"
    )
    print(
        f"  {'layout':<34} {'samples/s':>9} {'(min-max)':>15} {'speedup':>8} {'MFU':>6} "
        f"{'bubble':>7} {'theory':>7}"
    )
    for name, runs in results.items():
        rates = [r["rate"] for r in runs]
        median = statistics.median(rates)
        spread = f"({min(rates):.1f}-{max(rates):.1f})"
        mfu = statistics.median(r["mfu"] for r in runs)
        bubble = theory = "-"
        if runs[0]["bubble"] is not None:
            bubble = f"{statistics.median(r['bubble'] for r in runs):.1%}"
            theory = f"{runs[0]['theory']:.1%}"
        print(
            f"  {name:<34} {median:9.1f} {spread:>15} {median / base:7.2f}x {mfu:5.1f}% "
            f"{bubble:>7} {theory:>7}"
        )


if __name__ == "__main__":
    main()
