"""The loop a PyTorch user writes by hand for shardwise's built-in GPT: the baseline of
bench/gpu_throughput.py (and of the operator-count test, tests/distributed/test_step.py).

It is what a careful user writes: the same model, data, micro-batch, AdamW (fused, the same
parameter groups), schedule and clipping; bf16 autocast where asked; pinned memory and
non-blocking copies on a GPU; `loss.item()` only at log steps; compiled, `torch.compile(model)`
on the whole model. Its step and shardwise's can be profiled over the same steps and counted by
the same function (shardwise.training.trainer.profile.step_counts).

    python bench/hand_loop.py --set train.steps=100 [--compiled]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "examples" / "text-gpt.toml"
TINY = (2, 2, 32, 32, 4)
"""A GPT too small to compute anything (layers, heads, hidden, sequence, micro-batch): its step
is the host's work around the kernels."""


def job_sets(size: tuple[int, int, int, int, int], precision: str, steps: int) -> list[str]:
    """`--set` overrides of examples/text-gpt.toml for one GPT size, one micro-batch per step,
    without evaluation, checkpoints or MLflow (the hand loop has none)."""
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


def hand_loop(
    sets: list[str],
    *,
    compiled: bool,
    profile_window: tuple[int, int] | None = None,
    float8: str = "",
) -> list[dict[str, Any]]:
    """Train as a user would; prints `step N loss L` every `tracking.log_every` steps. With
    `profile_window` (first step, count) those steps are profiled and their counts returned;
    `float8`: a torchao recipe, the linears `train.float8_layers` names converted (as a user of
    torchao converts them: `convert_to_float8_training`, before compiling)."""
    from torch.profiler import ProfilerActivity, profile, record_function
    from torch.utils.data import DataLoader, RandomSampler

    from shardwise.training import job_names
    from shardwise.training.config.load import load_config
    from shardwise.training.trainer.optim import build_optimizer, lr_factor
    from shardwise.training.trainer.profile import STEP, step_counts

    config = load_config(str(JOB), sets)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(config.job.seed)
    model = job_names.build_model(config).to(device)
    train = config.train
    if float8:
        _to_float8(model, float8, train.float8_layers, emulate=not cuda)
    optimizer = build_optimizer(model, train, lr=train.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: lr_factor(k + 1, train))
    forward = torch.compile(model) if compiled else model
    train_set, _ = job_names.build_datasets(config)
    sampler = RandomSampler(train_set, generator=torch.Generator().manual_seed(0))
    micro = train.micro_batch or train.global_batch
    loader = DataLoader(
        train_set, batch_size=micro, sampler=sampler, drop_last=True, pin_memory=cuda
    )
    loss_fn = job_names.build_loss(config)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(train.precision)
    first, count = profile_window or (0, 0)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    profiler = profile(activities=activities)
    if cuda:
        os.environ.setdefault("TEARDOWN_CUPTI", "1")
    step, batches = 0, iter(loader)
    while step < train.steps:
        step += 1
        if step == first:
            profiler.__enter__()
        profiled = first <= step < first + count
        with record_function(f"{STEP}#{step}") if profiled else contextlib.nullcontext():
            batch = next(batches, None)
            if batch is None:  # the next epoch
                batches = iter(loader)
                batch = next(batches)
            inputs = batch[0].to(device, non_blocking=True)
            target = batch[1].to(device, non_blocking=True)
            with torch.autocast(
                device.type, dtype=dtype or torch.float32, enabled=dtype is not None
            ):
                loss = loss_fn(forward(inputs), target)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        if step == first + count - 1:
            profiler.__exit__(None, None, None)
        if step % config.tracking.log_every == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    return step_counts(profiler.events(), {}) if count else []


def _to_float8(model: torch.nn.Module, recipe: str, layers: Any, *, emulate: bool) -> None:
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from shardwise.training.parallel.float8 import chosen

    names = set(chosen(model, recipe, layers)[0])  # the layers shardwise converts
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
    convert_to_float8_training(model, module_filter_fn=lambda _, n: n in names, config=config)
    print(f"float8 ({recipe}): {len(names)} linear layers converted", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compiled", action="store_true")
    parser.add_argument("--float8", default="", help="a torchao recipe: tensorwise, rowwise, …")
    parser.add_argument("--set", dest="sets", action="append", default=[])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--counts", type=Path, default=None, help="profile steps 10-11 and write their counts here"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    window = (10, 2) if args.counts else None
    counts = hand_loop(args.sets, compiled=args.compiled, profile_window=window, float8=args.float8)
    if args.counts:
        args.counts.write_text(json.dumps({"steps": counts}))


if __name__ == "__main__":
    main()
