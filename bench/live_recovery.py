"""Live recovery (`fault.mode = "live"`) in real runs of `shardwise train`, against the default
(torch's DDP, a dead rank restarting every worker from the last checkpoint), same job, same run:

1. A step's cost with nothing failing: samples/s of the live replicas (their own all-reduce of
   gradients, buffers, loss and sample count) against DDP's, on the same processes, interleaved.
2. What a lost replica costs: replica 1 is SIGKILLed after a step; the survivors' detection
   (the failed collective), their stall (the kill's step done again without it, until it
   commits), and the replacement's heal (bytes, seconds), from the run's metrics.jsonl; against
   the default's restart of the same kill (the time from the kill until training again, from
   the same metrics).

    python bench/live_recovery.py                  # about 4 minutes on 2 cores
    python bench/live_recovery.py --kills 5 --repeats 3
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

BIN = Path(sys.executable).parent
JOB = Path(__file__).resolve().parents[1] / "examples" / "digits.toml"


def run(run_dir: Path, *sets: str, fault: str = "") -> tuple[dict, list[dict]]:
    env = {**os.environ, "SHARDWISE_FAULT": fault} if fault else dict(os.environ)
    command = [str(BIN / "shardwise"), "train", str(JOB), "--nproc", "2"]
    settings = [f"job.run_dir={run_dir}", "tracking.mlflow=false", "tracking.report=false"]
    for pair in (*settings, *sets):
        command += ["--set", pair]
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return summary, records


def step_cost(directory: Path, repeats: int) -> None:
    rates: dict[str, list[float]] = {"ddp": [], "live": []}
    for attempt in range(repeats):
        for mode in ("ddp", "live"):
            sets = ["train.steps=300", "tracking.log_every=50"]
            if mode == "live":
                sets.append("fault.mode=live")
            summary, _ = run(directory / f"{mode}{attempt}", *sets)
            rates[mode].append(summary["samples_per_second"])
    ddp, live = (statistics.median(rates[m]) for m in ("ddp", "live"))
    print(f"step cost, nothing failing (2 processes, digits CNN, medians of {repeats}):")
    print(f"  DDP {ddp:,.0f} samples/s {rates['ddp']}")
    print(f"  live {live:,.0f} samples/s {rates['live']}")
    print(f"  live / DDP: {live / ddp:.3f} (1 = no cost)")


def kills(directory: Path, count: int) -> None:
    detected, stalls, heals, heal_bytes, restarts = [], [], [], [], []
    for attempt in range(count):
        step = 20 + 7 * attempt
        _, records = run(
            directory / f"kill{attempt}",
            "train.steps=400",
            "tracking.log_every=400",
            "fault.mode=live",
            "fault.max_restarts=1",
            fault=f"kill:rank=1:step={step},slow:rank=0:step=1:seconds=0.02",
        )
        detected += [r["live/detected_s"] for r in records if "live/detected_s" in r]
        stalls += [r["live/stall_s"] for r in records if "live/stall_s" in r]
        heals += [r["live/heal_s"] for r in records if "live/heal_s" in r]
        heal_bytes += [r["live/heal_bytes"] for r in records if "live/heal_bytes" in r]
        _, records = run(
            directory / f"restart{attempt}",
            "train.steps=400",
            "tracking.log_every=1",
            "checkpoint.every_steps=10",
            "fault.max_restarts=1",
            fault=f"kill:rank=1:step={step}",
        )
        restarts.append(_restart_gap(records, step))
    print(f"a replica SIGKILLed, {count} runs:")
    print(f"  live: detected {_spread(detected)}; stall until the step commits {_spread(stalls)}")
    print(f"  live: heal {_spread(heals)} for {statistics.median(heal_bytes) / 2**20:.2f} MiB")
    print(f"  restart (default): kill to training again {_spread(restarts)}")
    if stalls and restarts:
        ratio = statistics.median(restarts) / statistics.median(stalls)
        print(f"  restart / live stall (medians): {ratio:.0f}x")


def _restart_gap(records: list[dict], step: int) -> float:
    """Seconds from the killed step's log to the first step logged after the restart."""
    times = [r["time"] for r in records if "loss" in r and r["step"] == step]
    after = [
        r["time"] for r in records if "loss" in r and r["time"] > times[0] and r["step"] <= step
    ]
    later = [
        r["time"] for r in records if "loss" in r and r["step"] > step and r["time"] > times[0]
    ]
    return (min(after) if after else min(later)) - times[0]


def _spread(values: list[float]) -> str:
    if not values:
        return "none"
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    median = statistics.median(values)
    return f"median {median:.3f} s, p95 {p95:.3f} s, max {max(values):.3f} s (n={len(values)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kills", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as temp:
        step_cost(Path(temp), args.repeats)
        kills(Path(temp), args.kills)


if __name__ == "__main__":
    main()
