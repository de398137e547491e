"""Where a checkpoint save's time goes, and how fast it is against `torch.save` of the same
tensors to the same directory followed by `os.fsync` (the baseline: what a user writes).

The state is a real run's: a GPT (default 12 × 768, 86M parameters) with its AdamW moments after
one step, about 1 GB, saved by the trainer's own `save` (training/trainer/persist.py) on one
rank: the state captured as DCP state dicts, written by DCP (serialise, write, fsync), hashed for
the manifest, committed. Synchronous and asynchronous saves (the stall: what the training loop
waits for) are interleaved with the baseline and repeated; medians and spreads are printed, with
each phase of the save.

    python bench/checkpoint_save.py                 # ~1 GB, 3 repeats: about 2 minutes here
    python bench/checkpoint_save.py --layers 4 --repeats 5
    python bench/checkpoint_save.py --device cuda --layers 24 --hidden 1024   # 304M on a GPU
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the small-job helpers


def build(layers: int, hidden: int, root: Path, asynchronous: bool, device: torch.device):
    """A one-rank run of the GPT whose optimizer has taken a step (its moments exist)."""
    from helpers import gpt_job
    from shardwise.training.trainer.build import build_run
    from shardwise.training.trainer.step import train_step

    config = gpt_job(
        root / f"run-{'async' if asynchronous else 'sync'}",
        model={"args": {"layers": layers, "heads": hidden // 64, "hidden": hidden, "seq_len": 32}},
        train={"global_batch": 1, "micro_batch": 1},
        checkpoint={"async": asynchronous, "keep_last": 1},
    )
    run = build_run(config, device)
    train_step(run, run.loader.next_step(), step=1)
    return run


def state_tensors(run) -> dict[str, torch.Tensor]:
    """The tensors a save writes, by name (what the baseline torch.save's)."""
    from shardwise.training.trainer.persist import capture

    state = capture(run, 1)
    flat = {f"model.{k}": v for k, v in state["model"].items()}
    flat |= {f"optim.{k}": v for k, v in state["optim"].items() if isinstance(v, torch.Tensor)}
    return flat


def baseline(tensors: dict[str, torch.Tensor], directory: Path) -> float:
    """torch.save of the tensors (from a GPU: torch copies each to the host) and fsync."""
    path = directory / "baseline.pt"
    began = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(tensors, f)
        f.flush()
        os.fsync(f.fileno())
    took = time.perf_counter() - began
    path.unlink()
    return took


def shardwise_save(run, step: int) -> tuple[float, float, dict[str, float]]:
    """(seconds until save returned: the loop's stall, seconds until committed, phases)."""
    from shardwise.training.trainer.persist import save

    began = time.perf_counter()
    save(run, step)
    returned = time.perf_counter() - began
    run.checkpoints.wait()
    return returned, time.perf_counter() - began, dict(run.checkpoints.phases)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="where the state lives: cpu or cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory(dir=REPO) as tmp:
        root = Path(tmp)
        store = dist.FileStore(str(root / "store"), 1)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=store, rank=0, world_size=1)
        sync_run = build(args.layers, args.hidden, root, asynchronous=False, device=device)
        async_run = build(args.layers, args.hidden, root, asynchronous=True, device=device)
        tensors = state_tensors(sync_run)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        print(f"state: {len(tensors)} tensors, {size / 1e9:.2f} GB; {os.cpu_count()} cores")
        found: dict[str, list[float]] = {}
        phases: dict[str, list[float]] = {}
        for repeat in range(args.repeats):  # interleaved: baseline, sync, async, …
            os.sync()  # each contender starts with nothing of another's left to write back
            found.setdefault("torch.save + fsync", []).append(baseline(tensors, root))
            os.sync()
            stall, total, parts = shardwise_save(sync_run, step=10 + repeat)
            found.setdefault("shardwise sync", []).append(total)
            for name, seconds in parts.items():
                phases.setdefault(f"sync {name}", []).append(seconds)
            os.sync()
            stall, total, parts = shardwise_save(async_run, step=10 + repeat)
            found.setdefault("shardwise async: stall", []).append(stall)
            found.setdefault("shardwise async: committed", []).append(total)
            print(
                f"  repeat {repeat + 1}: "
                + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in found.items())
            )
        dist.destroy_process_group()
    print(f"\nsave of {size / 1e9:.2f} GB (median of {args.repeats}; spread)")
    for name, values in found.items():
        print(
            f"  {name:<28} {statistics.median(values):6.2f} s ({min(values):.2f}-{max(values):.2f})"
            f"  {size / statistics.median(values) / 1e9:6.2f} GB/s"
        )
    for name, values in phases.items():
        print(f"    {name:<26} {statistics.median(values):6.2f} s")
    base = found["torch.save + fsync"]
    sync = found["shardwise sync"]
    ratio = statistics.median(b / s for b, s in zip(base, sync, strict=True))
    stall = statistics.median(
        a / s for a, s in zip(found["shardwise async: stall"], sync, strict=True)
    )
    print(f"  sync bandwidth / torch.save's: {ratio:.2f} (target >= 0.8)")
    print(f"  async stall / sync save: {stall:.2f} (target <= 0.10)")


if __name__ == "__main__":
    main()
