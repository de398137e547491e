"""shardwise against a hand-written PyTorch loop on one device, the built-in GPT at three sizes,
eager and compiled: tokens/s, their ratio, and MFU. Runs on a GPU (bf16) or, where there is none,
on the CPU (fp32, small sizes).

The hand loop (`--hand`, run by this script) is what a PyTorch user writes: the same model, data,
micro-batch, AdamW (fused, the same parameter groups), schedule and clipping; bf16 autocast on a
GPU; pinned memory and non-blocking copies; `loss.item()` only at log steps; compiled, it is
`torch.compile(model)` on the whole model (the stronger baseline: shardwise compiles per block).

Method (../shared/DESIGN.md, "Performance method"): each contender is a process of its own,
started the same way, one process, one device. Each prints a line every `log_every` steps (a
line needs the loss on the host, so the device has caught up when it is printed); the
steady-state step time is (time of the last line - time of the line after warm-up) / steps
between. Contenders are interleaved and the whole set repeated; medians and spreads are printed.
MFU = tokens/s × FLOPs per token (counted on the meta device, trainer/flops.py) / the matrix-
multiply peak this script measures once at start, the same figure for every contender.

    python bench/gpu_throughput.py                    # CPU: about 20 minutes on 2 cores
    python bench/gpu_throughput.py --repeats 1 --sizes small
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from ddp_overhead import timed  # the same step-line clock (bench/ is on the path)

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SIZES = {
    # name: (layers, heads, hidden, seq, micro batch) on a GPU; GPT-2 small, medium and ~1.2B
    "cuda": {
        "86M": (12, 12, 768, 1024, 8),
        "304M": (24, 16, 1024, 1024, 8),
        "1.2B": (24, 16, 2048, 1024, 4),
    },
    "cpu": {
        "small": (2, 4, 128, 128, 8),
        "medium": (4, 4, 256, 128, 8),
        "large": (6, 6, 384, 128, 4),
    },
}


def job_sets(size: tuple[int, int, int, int, int], precision: str, steps: int) -> list[str]:
    layers, heads, hidden, seq, micro = size
    return [
        f"model.args.layers={layers}",
        f"model.args.heads={heads}",
        f"model.args.hidden={hidden}",
        f"model.args.seq_len={seq}",
        f"data.args.seq_len={seq}",
        "data.args.max_bytes=4000000",
        f"train.global_batch={micro}",
        f"train.micro_batch={micro}",
        f"train.precision={precision}",
        f"train.steps={steps}",
        "eval.every_steps=0",
        "checkpoint.every_steps=0",
        "tracking.mlflow=false",
        "tracking.log_every=5",
    ]


def shardwise_cmd(sets: list[str], compiled: bool, run_dir: Path) -> list[str]:
    extra = [f"train.compile={str(compiled).lower()}", f"job.run_dir={run_dir}"]
    flags = [a for s in [*sets, *extra] for a in ("--set", s)]
    return [str(BIN / "shardwise"), "train", "examples/text-gpt.toml", "--nproc", "1", *flags]


def hand_cmd(sets: list[str], compiled: bool) -> list[str]:
    flags = [a for s in sets for a in ("--set", s)]
    return [sys.executable, __file__, "--hand", *(["--compiled"] if compiled else []), *flags]


def hand_loop(sets: list[str], compiled: bool) -> None:
    """The loop a PyTorch user writes by hand (the baseline)."""
    from torch.utils.data import DataLoader, RandomSampler

    from shardwise import builders
    from shardwise.config import load_config
    from shardwise.trainer.optim import build_optimizer, lr_factor

    config = load_config(str(REPO / "examples/text-gpt.toml"), sets)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(config.job.seed)
    model = builders.build_model(config).to(device)
    train = config.train
    optimizer = build_optimizer(model, train, lr=train.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: lr_factor(k + 1, train))
    forward = torch.compile(model) if compiled else model
    train_set, _ = builders.build_datasets(config)
    sampler = RandomSampler(train_set, generator=torch.Generator().manual_seed(0))
    micro = train.micro_batch or train.global_batch
    loader = DataLoader(
        train_set, batch_size=micro, sampler=sampler, drop_last=True, pin_memory=cuda
    )
    loss_fn = builders.build_loss(config)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(train.precision)
    step = 0
    while step < train.steps:
        for inputs, target in loader:
            inputs = inputs.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            with torch.autocast(
                device.type, dtype=dtype or torch.float32, enabled=dtype is not None
            ):
                loss = loss_fn(forward(inputs), target)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % config.tracking.log_every == 0:
                print(f"step {step} loss {loss.item():.4f}", flush=True)
            if step == train.steps:
                return


def flops_per_step(size: tuple[int, int, int, int, int]) -> float:
    from shardwise.builders import LOSSES
    from shardwise.models.gpt import build_gpt
    from shardwise.trainer.flops import count_flops, meta_batch

    layers, heads, hidden, seq, micro = size
    with torch.device("meta"):
        model = build_gpt(layers=layers, heads=heads, hidden=hidden, seq_len=seq)
    tokens = torch.zeros(seq, dtype=torch.long)
    return count_flops(model, LOSSES["cross_entropy"], *meta_batch((tokens, tokens), micro))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hand", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--compiled", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--set", dest="sets", action="append", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes", nargs="+", default=None, help="names from SIZES")
    parser.add_argument("--steps", type=int, default=None, help="per run (default 60 GPU, 40 CPU)")
    parser.add_argument("--no-compile", action="store_true", help="eager contenders only")
    args = parser.parse_args()
    if args.hand:
        hand_loop(args.sets, args.compiled)
        return
    from shardwise.trainer.flops import measure_peak

    kind = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(kind)
    precision = "bf16" if kind == "cuda" else "fp32"
    # the clock starts after the first steps: compiling (step 1) and shardwise's profiler
    # window (tracking.profile_step, steps 10 and 11) are one-off costs, reported apart
    warmup = 20 if kind == "cuda" else 15
    steps = args.steps or (warmup + 40 if kind == "cuda" else warmup + 25)
    peak = measure_peak(device, torch.bfloat16 if kind == "cuda" else torch.float32)
    name = torch.cuda.get_device_name() if kind == "cuda" else f"{os.cpu_count()} CPU cores"
    print(f"{name}; torch {torch.__version__}; {precision}; {peak.describe()}")
    modes = [False] if args.no_compile else [False, True]
    sizes = {k: v for k, v in SIZES[kind].items() if not args.sizes or k in args.sizes}
    for label, size in sizes.items():
        sets = job_sets(size, precision, steps)
        per_token = flops_per_step(size) / (size[3] * size[4])
        times: dict[str, list[float]] = {}
        with tempfile.TemporaryDirectory() as tmp:
            for repeat in range(args.repeats):
                for compiled in modes:  # interleaved: shardwise, hand, shardwise, hand, …
                    mode = "compiled" if compiled else "eager"
                    run_dir = Path(tmp) / f"{mode}-{repeat}"
                    for who, cmd in (
                        ("shardwise", shardwise_cmd(sets, compiled, run_dir)),
                        ("hand loop", hand_cmd(sets, compiled)),
                    ):
                        per_step, _ = timed(cmd, warmup, steps)
                        times.setdefault(f"{who} {mode}", []).append(per_step)
        tokens = size[3] * size[4]
        print(
            f"\nGPT {label}: layers {size[0]}, hidden {size[2]}, seq {size[3]}, "
            f"micro batch {size[4]}"
        )
        for contender, values in times.items():
            step = statistics.median(values)
            rate = tokens / step
            print(
                f"  {contender:<20} {step * 1e3:8.1f} ms/step ({min(values) * 1e3:.1f}-"
                f"{max(values) * 1e3:.1f})  {rate:10,.0f} tokens/s  MFU "
                f"{100 * rate * per_token / peak.measured:5.1f}%"
            )
        for mode in ("eager", "compiled") if len(modes) == 2 else ("eager",):
            ratios = [
                h / s
                for s, h in zip(times[f"shardwise {mode}"], times[f"hand loop {mode}"], strict=True)
            ]
            print(
                f"  tokens/s shardwise / hand loop, {mode}: median {statistics.median(ratios):.3f} "
                f"(spread {min(ratios):.3f}-{max(ratios):.3f}; target >= 1.00 on a GPU, "
                ">= 0.97 on CPU)"
            )


if __name__ == "__main__":
    main()
