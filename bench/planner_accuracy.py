"""How well `shardwise plan` predicts shardwise's own runs on this machine: step time and memory
per rank, predicted from a profile calibrated in the same run, against measured, for each layout
the trainer supports on 2 ranks (and 1 process), as ratios. Targets: step time within ±25%,
memory within ±10%.

Method: calibrate this machine (plan/calibrate.py: matmul rate, a transformer layer's curve
(its rate on large layers and its overhead per layer and micro-batch), memory bandwidth, α/β of
gloo's all-reduce, all-gather and reduce-scatter, a tensor-parallel layer's rate, the runtime's
memory), then run `shardwise train` for each layout
with one thread per rank (a "device" is a core), the compute and memory rates measured again
right before and right after each run (their mean predicts it), and compare:
- step time: global batch / median samples/s over the logged windows after warm-up;
- memory: the largest rank's peak resident set after the second step (the first with optimizer
  state) minus what the process held before the model was built (interpreter, torch, process
  group), in a separate short run with glibc's mmap threshold fixed (MALLOC_MMAP_THRESHOLD_) so
  freed tensors leave the resident set (the calibration measures the runtime's memory the same
  way).

    python bench/planner_accuracy.py                 # about 30 minutes on 2 cores
    python bench/planner_accuracy.py --steps 12 --repeats 1
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
MODEL = ["model.args.layers=6", "model.args.heads=8", "model.args.hidden=512"]
COMMON = [
    *MODEL,
    "model.args.seq_len=128",
    "data.args.seq_len=128",
    "model.args.dropout=0.0",
    "data.args.max_bytes=1000000",
    "train.global_batch=8",
    "train.micro_batch=2",
    "train.precision=fp32",
    "job.threads_per_rank=1",
    "eval.every_steps=0",
    "eval.max_samples=8",
    "tracking.mlflow=false",
    "tracking.log_every=2",
]
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "1 process": (1, []),
    "DDP 2": (2, []),
    "FSDP 2, ZeRO-3": (2, ["parallel.dp_shard=2"]),
    "FSDP 2, params held (ZeRO-2)": (
        2,
        ["parallel.dp_shard=2", "parallel.reshard_after_forward=false"],
    ),
    "FSDP 2, ZeRO-3 + full recompute": (
        2,
        ["parallel.dp_shard=2", "parallel.activation_checkpoint=full"],
    ),
    "TP 2": (2, ["parallel.tp=2"]),
    "TP 2 + sequence parallel": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "PP 2 GPipe": (2, ["parallel.pp=2", "parallel.pipeline_schedule=GPipe"]),
    "PP 2 1F1B": (2, ["parallel.pp=2", "parallel.pipeline_schedule=1F1B"]),
    "PP 2 Interleaved1F1B": (2, ["parallel.pp=2", "parallel.pipeline_schedule=Interleaved1F1B"]),
}


def train(
    nproc: int, sets: list[str], steps: int, run_dir: Path, *, for_memory: bool = False
) -> dict[str, Any]:
    overrides = [*COMMON, *sets, f"train.steps={steps}", f"job.run_dir={run_dir}"]
    cmd = [str(BIN / "shardwise"), "train", "examples/text-gpt.toml", "--nproc", str(nproc)]
    cmd += [a for s in overrides for a in ("--set", s)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if for_memory:
        # glibc keeps freed heap memory (and raises its mmap threshold as large blocks are
        # freed), so the resident set would count memory torch already gave back; a fixed
        # threshold maps large tensors and returns them on free, and the resident set follows
        # live tensors. It also makes every large allocation fault its pages in (20–30% slower
        # steps), so memory is measured in a run of its own.
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    done = subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL
    )
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    summary: dict[str, Any] = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    second = next(r for r in records if any(k.endswith("/peak") for k in r))
    ranks = sorted({k.split("/")[1] for k in second if k.startswith("memory/")})
    summary["trained_bytes"] = max(
        second[f"memory/{r}/peak"] - second[f"memory/{r}/baseline"] for r in ranks
    )
    summary["states_bytes"] = max(
        sum(second[f"memory/{r}/{k}"] for k in ("params", "grads", "optimizer")) for r in ranks
    )
    return summary


def planned(nproc: int, sets: list[str]) -> Any:
    """The layout's job as the planner sees it (its model built and traced on the meta device)."""
    from shardwise.plan.job import plan_job
    from shardwise.training.config.load import load_config

    config = load_config(REPO / "examples/text-gpt.toml", [*COMMON, *sets, "train.steps=1"])
    return plan_job(config, nproc)


def predict(job: Any, nproc: int, hardware: Any) -> tuple[float, float, float]:
    """Predicted seconds per step, memory per rank, and model-state bytes per rank."""
    from shardwise.plan.search import Plan

    plan = Plan(
        job.model, hardware, job.precision, job.optimizer, nproc, job.layout.global_batch, None,
        dropout=job.dropout, fused_attention=job.fused_attention, traced=job.traced,
    )  # fmt: skip
    own = plan.evaluate(job.layout)
    memory = own.memory
    return own.time.total, memory.total, memory.params + memory.grads + memory.optimizer


def recalibrated(hardware: Any) -> Any:
    """The profile with its compute and memory rates measured again now (every core at once,
    about 3 s): this VM's speed drifts by 20% over minutes, so each run is predicted from rates
    taken around it; the collectives' fits are kept from the full calibration."""
    from dataclasses import replace

    from shardwise.plan.calibrate import per_core_rates

    peak, layer, overhead, bandwidth = per_core_rates(hardware.gpus_per_node)
    return replace(
        hardware,
        peak_flops=peak,
        utilisation=min(1.0, layer / peak),
        layer_overhead=overhead,
        memory_bandwidth=bandwidth,
    )


def averaged(a: Any, b: Any) -> Any:
    """The profile with the mean of two measurements of its compute and memory rates (and the
    layer's overhead)."""
    from dataclasses import replace

    return replace(
        a,
        peak_flops=(a.peak_flops + b.peak_flops) / 2,
        utilisation=(a.peak_flops * a.utilisation + b.peak_flops * b.utilisation)
        / (a.peak_flops + b.peak_flops),
        layer_overhead=(a.layer_overhead + b.layer_overhead) / 2,
        memory_bandwidth=(a.memory_bandwidth + b.memory_bandwidth) / 2,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", nargs="*", help="layout names to run (default all)")
    args = parser.parse_args()
    from shardwise.plan.calibrate import calibrate
    from shardwise.plan.plan_report import summary_of

    hardware = calibrate(progress=lambda line: print(line, flush=True))
    print(f"profile: {summary_of(hardware)}\n", flush=True)
    chosen = {n: v for n, v in LAYOUTS.items() if not args.only or n in args.only}
    jobs = {name: planned(nproc, sets) for name, (nproc, sets) in chosen.items()}
    runs: dict[str, list[tuple[float, float]]] = {n: [] for n in chosen}  # (measured, predicted)
    memory: dict[str, tuple[float, float, float, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for i, (name, (nproc, sets)) in enumerate(chosen.items()):
                before = recalibrated(hardware)
                summary = train(nproc, sets, args.steps, Path(tmp) / f"{repeat}-{i}")
                now = averaged(before, recalibrated(hardware))
                step, total, states = predict(jobs[name], nproc, now)
                measured = 8 / summary["samples_per_second"]
                runs[name].append((measured, step))
                if repeat == 0:
                    held = train(nproc, sets, 3, Path(tmp) / f"memory-{i}", for_memory=True)
                    memory[name] = (held["trained_bytes"], held["states_bytes"], total, states)
                print(
                    f"  repeat {repeat + 1}: {name:<32} {measured * 1e3:8.1f} ms/step, "
                    f"predicted {step * 1e3:8.1f} (layer rate now "
                    f"{now.peak_flops * now.utilisation / 1e9:.1f} GFLOP/s per core + "
                    f"{now.layer_overhead * 1e3:.1f} ms per layer and micro-batch)",
                    flush=True,
                )
    print(
        f"\n  {'layout':<32} {'step ms':>8} {'predicted':>9} {'ratio':>6}   "
        f"{'MiB/rank':>8} {'predicted':>9} {'ratio':>6}   {'states ratio':>12}"
    )
    time_ok = memory_ok = 0
    for name in chosen:
        measured = statistics.median(m for m, _ in runs[name])
        step = statistics.median(p for _, p in runs[name])
        t_ratio = statistics.median(p / m for m, p in runs[name])
        trained, held, total, states = memory[name]
        m_ratio = total / trained
        time_ok += abs(t_ratio - 1) <= 0.25
        memory_ok += abs(m_ratio - 1) <= 0.10
        print(
            f"  {name:<32} {measured * 1e3:8.1f} {step * 1e3:9.1f} {t_ratio:6.2f}   "
            f"{trained / 2**20:8.1f} {total / 2**20:9.1f} {m_ratio:6.2f}   {states / held:12.3f}"
        )
    print(
        f"\n  within ±25% on step time: {time_ok}/{len(chosen)}; within ±10% on memory: "
        f"{memory_ok}/{len(chosen)} (ratios are predicted / measured; step-time ratio: median "
        "of each run's own)"
    )


if __name__ == "__main__":
    main()
