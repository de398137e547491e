"""Step time of the GPT example trained on tokenised text streamed from an S3-compatible server on
loopback (moto), against the same rows held in memory (a map-style dataset), in the same run.

Both contenders are `shardwise train examples/gpt-parquet.toml --nproc 2` (fp32, one torch thread
per rank): one reads the Parquet shards from `s3://bench/tokens/` as the example does; the other
names `bench.stream_step:in_memory`, which reads the same rows into memory before training. The
steady-state step time is measured as bench/ddp_overhead.py does (the timestamps of the step
lines between the warm-up step and the last); contenders alternate and repeat, and the medians
are printed with their ratio (target: streaming within 3% of memory).

    python bench/stream_step.py
    python bench/stream_step.py --repeats 5 --steps 80
    python bench/stream_step.py --nproc 1 --set job.device=cuda   # on one GPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import TensorDataset

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from ddp_overhead import timed  # noqa: E402 (a sibling script)
from local_s3 import local_s3  # noqa: E402

URL = "s3://bench/tokens/"
EVAL = "s3://bench/tokens-eval/"


def in_memory(*, path: str, eval_path: str, **_: Any) -> tuple[TensorDataset, TensorDataset]:
    """The same rows as the streamed job, every one read into memory first: (inputs, next)."""
    import pyarrow.dataset as ds
    from fsspec.core import url_to_fs

    def load(url: str) -> TensorDataset:
        fs, root = url_to_fs(url)
        table = ds.dataset(root, filesystem=fs, format="parquet").to_table(columns=["tokens"])
        tokens = table.column(0).combine_chunks().flatten().to_numpy().astype("int64")
        rows = torch.from_numpy(tokens).reshape(len(table), -1)
        return TensorDataset(rows[:, :-1], rows[:, 1:])

    return load(path), load(eval_path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--nproc", type=int, default=2, help="ranks (one per GPU on GPUs)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="more job overrides"
    )
    args = parser.parse_args()

    with local_s3() as fs:
        with tempfile.TemporaryDirectory() as tmp:
            import subprocess

            subprocess.run(
                [sys.executable, "examples/make_tables.py", "--out", tmp, "--tables", "tokens"],
                cwd=REPO,
                check=True,
            )
            fs.put(f"{tmp}/tokens", "bench/tokens", recursive=True)
            fs.put(f"{tmp}/tokens-eval", "bench/tokens-eval", recursive=True)
        common = [
            "train.precision=fp32", "eval.every_steps=0", "checkpoint.every_steps=0",
            "tracking.mlflow=false", "tracking.log_every=1", "tracking.report=false",
            f"train.steps={args.steps}", *args.set,
        ]  # fmt: skip
        contenders = {
            "streamed from S3": [f"data.args.path={URL}", f"data.args.eval_path={EVAL}"],
            "in memory": [
                "data.name=bench.stream_step:in_memory",
                f"data.args.path={URL}",
                f"data.args.eval_path={EVAL}",
            ],
        }
        times: dict[str, list[float]] = {name: [] for name in contenders}
        with tempfile.TemporaryDirectory() as runs:
            for repeat in range(args.repeats):
                for name, sets in contenders.items():
                    run_dir = Path(runs) / f"{repeat}-{name.replace(' ', '_')}"
                    flags = [a for s in [*common, *sets, f"job.run_dir={run_dir}"]
                             for a in ("--set", s)]  # fmt: skip
                    cmd = [str(Path(sys.executable).parent / "shardwise"), "train",
                           "examples/gpt-parquet.toml", "--nproc", str(args.nproc),
                           *flags]  # fmt: skip
                    step, _ = timed(cmd, args.warmup, args.steps)
                    times[name].append(step)
                    print(
                        f"  repeat {repeat + 1}: {name:<18} {step * 1e3:8.1f} ms/step", flush=True
                    )
        for name, values in times.items():
            print(f"{name:>18}: {statistics.median(values) * 1e3:8.1f} ms/step (median)")
        ratio = statistics.median(times["streamed from S3"]) / statistics.median(times["in memory"])
        print(f"streamed / in memory: {ratio:.3f} (target <= 1.03)")


if __name__ == "__main__":
    main()
