"""Recovery from a killed rank, and what a checkpoint save costs the training loop.

1. Kill → progress: `shardwise train examples/text-gpt.toml --nproc 2` with `fault.max_restarts=1`
   and rank 1 SIGKILLed right after a chosen step (SHARDWISE_FAULT). From metrics.jsonl: the time
   from the kill (the killed step's record) to the first step trained after the restart, and the
   steps redone (the kill step minus the checkpoint the restart resumed from).
2. Save blocking time: the `checkpoint/save_s` the loop records for each DCP save (time the ranks
   spend in the save, sharded, with manifest and checksums), against a plain `torch.save` of the
   same model and optimizer state to the same disk, timed in this process in the same run.

    python bench/fault_recovery.py                   # about 5 minutes on 2 cores
    python bench/fault_recovery.py --repeats 1
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

import torch
from checkpoint_save import baseline  # the same torch.save + fsync (bench/ is on the path)

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
JOB = [
    "train.steps=60",
    "checkpoint.every_steps=20",
    "checkpoint.keep_last=5",
    "tracking.mlflow=false",
    "tracking.log_every=1",
    "eval.every_steps=0",
    "eval.max_samples=16",
    "fault.max_restarts=1",
]


def run(run_dir: Path, fault: str | None, *extra: str) -> list[dict]:
    items = [*JOB, *extra, f"job.run_dir={run_dir}"]
    overrides = [arg for item in items for arg in ("--set", item)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if fault:
        env["SHARDWISE_FAULT"] = fault
    subprocess.run(
        [str(BIN / "shardwise"), "train", "examples/text-gpt.toml", "--nproc", "2", *overrides],
        cwd=REPO,
        env=env,
        check=True,
        capture_output=True,
        stdin=subprocess.DEVNULL,
    )
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def recovery(records: list[dict], kill_step: int) -> tuple[float, int]:
    """Seconds from the killed step's record to the first step after the restart; steps redone."""
    killed_at = next(r["time"] for r in records if r.get("step") == kill_step and "loss" in r)
    resume = next(r for r in records if r.get("event") == "resume")
    first = next(r for r in records[records.index(resume) :] if "loss" in r)
    return first["time"] - killed_at, kill_step - resume["step"]


def plain_torch_save(directory: Path) -> float:
    """torch.save of the same GPT's model and AdamW state (after one step) to the same disk."""
    from shardwise.models.gpt import build_gpt
    from shardwise.training.config.load import load_config

    config = load_config(REPO / "examples" / "text-gpt.toml")
    model = build_gpt(**config.model.args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.zeros(2, config.model.args.get("seq_len", 128), dtype=torch.long)).sum().backward()
    optimizer.step()
    return baseline({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    kills, redone, saves, async_saves, plain = [], [], [], [], []
    with tempfile.TemporaryDirectory(prefix="shardwise-bench-") as tmp:
        for r in range(args.repeats):
            kill_step = 30 + 3 * r
            records = run(Path(tmp) / f"kill{r}", f"kill:rank=1:step={kill_step}")
            seconds, steps = recovery(records, kill_step)
            kills.append(seconds)
            redone.append(steps)
            saves += [x["checkpoint/save_s"] for x in records if "checkpoint/save_s" in x]
            records = run(Path(tmp) / f"async{r}", None, "checkpoint.async=true")
            # the last save is waited for at the end of the run; the others overlap training
            timed = [x["checkpoint/save_s"] for x in records if "checkpoint/save_s" in x]
            async_saves += timed[:-1]
            plain.append(plain_torch_save(Path(tmp)))
            print(
                f"  repeat {r + 1}: kill at step {kill_step} → training again after "
                f"{seconds:.1f} s, {steps} steps redone; plain torch.save {plain[-1]:.3f} s",
                flush=True,
            )
    print("\nrecovery from a SIGKILLed rank (2 ranks, text-gpt, checkpoint every 20 steps)")
    print(
        f"  kill → progress again: median {statistics.median(kills):.1f} s "
        f"(spread {min(kills):.1f}-{max(kills):.1f}); steps redone {redone}"
    )
    print("checkpoint save, time the training loop is blocked")
    med_save, med_plain = statistics.median(saves), statistics.median(plain)
    med_async = statistics.median(async_saves)
    print(
        f"  shardwise DCP save, sync (sharded, manifest, checksums): median {med_save:.3f} s "
        f"over {len(saves)} saves (spread {min(saves):.3f}-{max(saves):.3f})"
    )
    print(
        f"  shardwise DCP save, async (checkpoint.async): median {med_async:.3f} s over "
        f"{len(async_saves)} saves (spread {min(async_saves):.3f}-{max(async_saves):.3f})"
    )
    print(f"  plain torch.save of the same state: median {med_plain:.3f} s")
    print(
        f"  ratios: sync / torch.save {med_save / med_plain:.2f}, async / torch.save "
        f"{med_async / med_plain:.2f}, async / sync {med_async / med_save:.2f}"
    )


if __name__ == "__main__":
    main()
