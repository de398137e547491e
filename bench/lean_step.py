"""A training step's own cost: shardwise against the DDP loop written by hand and against
Lightning Fabric, on PyTorch's tutorial CNN (two convolutions, two linear layers, 3×32×32
images), 2 gloo ranks of one thread each, the same data, batch, optimizer (AdamW with
shardwise's parameter groups), schedule and gradient clipping in all three.

Steady state without start-up or shutdown: each contender is run to 420 steps and to 20 steps,
whole programs, and its step time is the difference of the two wall times over 400 steps;
contenders and lengths interleaved, `--repeats` times; medians and spreads printed, and the
ratios to the hand loop and to Fabric (Fabric is a bench-only dependency:
`pip install 'shardwise[bench]'`).

    python bench/lean_step.py                  # about 6 minutes on 2 cores
    python bench/lean_step.py --repeats 3 --only hand,shardwise

Run one contender's loop (what the driver starts under torchrun):

    torchrun --standalone --nproc-per-node 2 bench/lean_step.py --loop hand --steps 420
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SAMPLES, GLOBAL_BATCH, LR, SEED = 4096, 64, 1e-3, 0
LONG, SHORT = 420, 20


class TutorialCNN(nn.Module):
    """PyTorch's "Training a classifier" network, with two linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        out: torch.Tensor = self.fc2(torch.relu(self.fc1(torch.flatten(x, 1))))
        return out


def tutorial_cnn() -> nn.Module:
    return TutorialCNN()


def cifar_like() -> tuple[TensorDataset, None]:
    """4,096 random 3×32×32 images in 10 classes, the same on every rank and contender."""
    generator = torch.Generator().manual_seed(SEED)
    images = torch.randn(SAMPLES, 3, 32, 32, generator=generator)
    labels = torch.randint(0, 10, (SAMPLES,), generator=generator)
    return TensorDataset(images, labels), None


# ---- the loops, one per contender (run under torchrun) ----


def _optimizer(model: nn.Module) -> tuple[torch.optim.Optimizer, object]:
    from shardwise.training.config.schema import TrainSection
    from shardwise.training.trainer.optim import build_optimizer, lr_factor

    train = TrainSection(steps=LONG, global_batch=GLOBAL_BATCH, lr=LR)
    optimizer = build_optimizer(model, train, lr=LR)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: lr_factor(k + 1, train))
    return optimizer, schedule


def hand_loop(steps: int) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(SEED)
    model = DistributedDataParallel(tutorial_cnn())
    train_set, _ = cifar_like()
    sampler = DistributedSampler(train_set, shuffle=True, seed=SEED, drop_last=True)
    per_rank = GLOBAL_BATCH // dist.get_world_size()
    loader = DataLoader(train_set, batch_size=per_rank, sampler=sampler, drop_last=True)
    optimizer, schedule = _optimizer(model)
    step, epoch, began = 0, 0, 0.0
    while step < steps:
        sampler.set_epoch(epoch)
        for inputs, target in loader:
            loss = nn.functional.cross_entropy(model(inputs), target)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()  # type: ignore[attr-defined]
            optimizer.zero_grad(set_to_none=True)
            step += 1
            began = time.perf_counter() if step == SHORT else began
            if step == steps:
                break
        epoch += 1
    _steady(began, steps, dist.get_rank())
    print(f"loss {loss.item():.4f}", flush=True)
    del model
    gc.collect()
    dist.destroy_process_group()


def fabric_loop(steps: int) -> None:
    from lightning_fabric import Fabric
    from torch.utils.data import DataLoader

    torch.set_num_threads(1)
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)
    fabric.launch()
    torch.manual_seed(SEED)
    model = tutorial_cnn()
    optimizer, schedule = _optimizer(model)
    model, optimizer = fabric.setup(model, optimizer)
    train_set, _ = cifar_like()
    per_rank = GLOBAL_BATCH // fabric.world_size
    loader = fabric.setup_dataloaders(
        DataLoader(train_set, batch_size=per_rank, shuffle=True, drop_last=True)
    )
    step, epoch, began = 0, 0, 0.0
    while step < steps:
        for inputs, target in loader:
            loss = nn.functional.cross_entropy(model(inputs), target)
            fabric.backward(loss)
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            schedule.step()  # type: ignore[attr-defined]
            optimizer.zero_grad(set_to_none=True)
            step += 1
            began = time.perf_counter() if step == SHORT else began
            if step == steps:
                break
        epoch += 1
    _steady(began, steps, fabric.global_rank)
    fabric.print(f"loss {loss.item():.4f}")


JOB = f"""
[job]
seed = {SEED}
threads_per_rank = 1
[model]
name = "bench.lean_step:tutorial_cnn"
[data]
name = "bench.lean_step:cifar_like"
[train]
steps = {LONG}
global_batch = {GLOBAL_BATCH}
lr = {LR}
grad_clip = 1.0
[eval]
every_steps = 0
[checkpoint]
every_steps = 0
[tracking]
mlflow = false
report = false
profile_step = 0
log_every = {SHORT}
"""


def _steady(began: float, steps: int, rank: int) -> None:
    """Rank 0's own clock over the steps after the first SHORT (no start-up, no shutdown)."""
    if rank == 0 and steps > SHORT:
        took = (time.perf_counter() - began) / (steps - SHORT) * 1e3
        print(f"steady {took:.3f} ms/step", flush=True)


def _job(run_dir: Path, steps: int) -> list[str]:
    """`shardwise train` on the same work (steps: the run's length; its schedule is LONG's)."""
    job = run_dir.parent / "job.toml"
    job.write_text(JOB)
    flags = ["--set", f"job.run_dir={run_dir}", "--set", f"train.steps={steps}"]
    return [str(BIN / "shardwise"), "train", str(job), "--nproc", "2", *flags]


# ---- the driver ----


def _command(contender: str, steps: int, run_dir: Path) -> list[str]:
    if contender == "shardwise":
        return _job(run_dir, steps)
    torchrun = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2"]
    return [*torchrun, __file__, "--loop", contender, "--steps", str(steps)]


def _timed(contender: str, steps: int) -> tuple[float, float | None]:
    """The whole program's wall time, and rank 0's own ms/step after the first SHORT steps
    (a run longer than SHORT): the hand loop and Fabric print it; shardwise's metrics.jsonl
    has each window's samples/s."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    with tempfile.TemporaryDirectory() as tmp:
        began = time.perf_counter()
        done = subprocess.run(
            _command(contender, steps, Path(tmp) / "run"),
            cwd=REPO, env=env, capture_output=True, text=True, check=False,
        )  # fmt: skip
        took = time.perf_counter() - began
        if done.returncode != 0:
            raise SystemExit(f"{contender} ({steps} steps) failed:\n{done.stdout}\n{done.stderr}")
        if steps <= SHORT:
            return took, None
        if contender == "shardwise":
            return took, _windows(Path(tmp) / "run" / "metrics.jsonl")
    steady = re.search(r"steady ([0-9.]+) ms/step", done.stdout)  # ranks' lines may interleave
    if steady is None:
        raise SystemExit(f"{contender} printed no steady state:\n{done.stdout}")
    return took, float(steady.group(1))


def _windows(metrics: Path) -> float:
    """ms/step over the windows after the first (each SHORT steps, from samples/s)."""
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    rates = [r["samples/s"] for r in records if "samples/s" in r and r["step"] > SHORT]
    seconds = sum(SHORT * GLOBAL_BATCH / rate for rate in rates)
    return seconds / (len(rates) * SHORT) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--loop", choices=("hand", "fabric"), help="run one contender's loop")
    parser.add_argument("--steps", type=int, default=LONG)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", default="hand,fabric,shardwise")
    args = parser.parse_args()
    if args.loop == "hand":
        return hand_loop(args.steps)
    if args.loop == "fabric":
        return fabric_loop(args.steps)
    contenders = args.only.split(",")
    programs: dict[str, list[float]] = {c: [] for c in contenders}
    own: dict[str, list[float]] = {c: [] for c in contenders}
    for repeat in range(args.repeats):
        for contender in contenders:
            (long, steady), (short, _) = _timed(contender, LONG), _timed(contender, SHORT)
            programs[contender].append((long - short) / (LONG - SHORT) * 1e3)
            assert steady is not None
            own[contender].append(steady)
            print(
                f"repeat {repeat + 1}: {contender:9s} whole programs {programs[contender][-1]:.2f} "
                f"ms/step ({LONG} steps {long:.1f} s, {SHORT} steps {short:.1f} s); rank 0's "
                f"own clock {steady:.2f} ms/step",
                flush=True,
            )
    for title, table in (
        (f"({LONG}-step program - {SHORT}-step program) / {LONG - SHORT}", programs),
        (f"rank 0's own clock over steps {SHORT + 1}-{LONG}", own),
    ):
        _summary(title, table, args.repeats)


def _summary(title: str, table: dict[str, list[float]], repeats: int) -> None:
    print(f"\n{title}, medians of {repeats} (min-max), 2 gloo ranks, 1 thread each:")
    medians = {c: statistics.median(v) for c, v in table.items()}
    for contender, values in table.items():
        print(
            f"  {contender:9s} {medians[contender]:6.2f} ms  ({min(values):.2f}-{max(values):.2f})"
        )
    if "shardwise" in medians:
        for other in ("hand", "fabric"):
            if other in medians:
                gap = medians["shardwise"] - medians[other]
                print(
                    f"  shardwise / {other}: {medians['shardwise'] / medians[other]:.3f} "
                    f"({gap:+.2f} ms a step)"
                )


if __name__ == "__main__":
    main()
