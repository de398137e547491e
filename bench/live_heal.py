"""A replacement replica healed from a live peer's memory (fault/heal.py) against what a restart
does today, reading the same state back from a checkpoint file (torch.save, then torch.load
with weights_only), in the same run, for a few state sizes.

The state is float32 tensors of 4 MiB each (a model's parameters and an optimizer's moments
look like this), `--sizes` MiB in all. The heal runs between two spawned processes on a gloo
group of loopback (membership.py's generation 0), timed on the receiver from its first receive
to its last, the receiver's tensors existing already (as a replacement's do, built from the job);
the baseline is timed in one process: the save (which the last checkpoint before a failure paid)
and the load (which the restart pays) apart, on the run directory's filesystem (`--dir`).
Medians of `--repeats`, contenders alternating.

    python bench/live_heal.py
    python bench/live_heal.py --sizes 64,512 --repeats 5
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from shardwise.training.fault.heal import receive_state, send_state
from shardwise.training.fault.membership import current, group, publish
from shardwise.training.launch.stores import LOOPBACK, host_store

CHUNK = 4 * 2**20 // 4  # float32 values in 4 MiB
TIMEOUT_S = 300.0


def _state(mib: int, fill: float) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.full((CHUNK,), fill + i) for i in range(max(1, mib // 4))}


def _side(slot: int, port: int, mib: int, results: object) -> None:
    store = TCPStore(LOOPBACK, port, is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
    pg = group(store, current(store, TIMEOUT_S), slot, TIMEOUT_S)
    tensors = _state(mib, 1.0 if slot == 0 else 0.0)
    if slot == 0:
        send_state(pg, 1, tensors, {"step": 1})
        return
    began = time.perf_counter()
    receive_state(pg, 0, tensors)
    seconds = time.perf_counter() - began
    assert all(
        torch.equal(t, torch.full((CHUNK,), 1.0 + i)) for i, t in enumerate(tensors.values())
    )
    results.put(seconds)  # type: ignore[attr-defined]


def heal_seconds(mib: int) -> float:
    store = host_store(
        LOOPBACK, 0, world_size=None, timeout=timedelta(seconds=TIMEOUT_S), multi_tenant=False
    )
    publish(store, 0, [0, 1])
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    sides = [context.Process(target=_side, args=(s, store.port, mib, results)) for s in (0, 1)]
    for process in sides:
        process.start()
    seconds = results.get(timeout=TIMEOUT_S)
    for process in sides:
        process.join(TIMEOUT_S)
    return float(seconds)


def checkpoint_seconds(mib: int, directory: Path) -> tuple[float, float]:
    tensors = _state(mib, 1.0)
    path = directory / "state.pt"
    began = time.perf_counter()
    torch.save(tensors, path)
    saved = time.perf_counter() - began
    began = time.perf_counter()
    loaded = torch.load(path, weights_only=True)
    read = time.perf_counter() - began
    assert loaded.keys() == tensors.keys()
    path.unlink()
    return saved, read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--sizes", default="16,128,512", help="MiB of state, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the checkpoint file goes")
    args = parser.parse_args()
    print("| state | heal from a peer | checkpoint load (save) | load / heal |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory(dir=args.dir) as temp:
        for mib in (int(s) for s in args.sizes.split(",")):
            heals, loads, saves = [], [], []
            for _ in range(args.repeats):
                heals.append(heal_seconds(mib))
                saved, read = checkpoint_seconds(mib, Path(temp))
                saves.append(saved)
                loads.append(read)
            heal, load, save = (statistics.median(v) for v in (heals, loads, saves))
            print(
                f"| {mib} MiB | {heal:.3f} s ({mib / heal:,.0f} MiB/s) | {load:.3f} s "
                f"({save:.3f} s) | {load / heal:.2f}× |",
                flush=True,
            )


if __name__ == "__main__":
    main()
