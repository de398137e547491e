"""shardwise against a hand-written PyTorch loop on one device, the built-in GPT, eager and
compiled: step time, tokens/s and their ratio, MFU, and what each step asks of the host and the
device (operators, kernels, host reads, compiled regions) beside shardwise's overhead per step,
phase by phase. Runs on a GPU (bf16) or, where there is none, on the CPU (fp32) with a GPT too
small to compute anything, one process and one thread: the host's work around the kernels,
which is what bounds a small model's step on a GPU.

The hand loop is bench/hand_loop.py: the same model, data, micro-batch, AdamW (fused, the same
parameter groups), schedule and clipping; compiled, `torch.compile(model)` on the whole model.
shardwise runs at its defaults (`shardwise train` with --set for the model size only, and one
thread per rank on the CPU, as the hand loop gets).

Method (../shared/DESIGN.md, "Performance method"): each contender is a process of its own,
started the same way. Each prints a line every `log_every` steps (a line needs the loss on the
host, so the device has caught up when it is printed); the steady-state step time is (time of
the last line - time of the line after warm-up) / steps between. Contenders are interleaved and
the whole set repeated; medians and spreads are printed. The counts come from the profiler over
the same steps of both (shardwise's own window, `tracking.profile_step`, and the hand loop's),
host reads from shardwise's read window after it (trainer/profile.py), all inside the warm-up.
MFU = tokens/s × FLOPs per token (counted on the meta device) / the peak the runs measure.

    python bench/gpu_throughput.py                        # CPU proxy: about 6 minutes here
    python bench/gpu_throughput.py --sizes 86M 1.2B       # on a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from ddp_overhead import timed  # the same step-line clock (bench/ is on the path)
from hand_loop import JOB, TINY, job_sets

from shardwise.training.trainer.flops import Peak

BIN = Path(sys.executable).parent
SIZES = {
    # name: (layers, heads, hidden, seq, micro batch); GPT-2 small, medium and ~1.2B on a GPU
    "cuda": {
        "86M": (12, 12, 768, 1024, 8),
        "304M": (24, 16, 1024, 1024, 8),
        "1.2B": (24, 16, 2048, 1024, 4),
        # float8 (issue 60): sequences of 2048, as torchao's and torchtitan's figures
        "1.2B-2k": (24, 16, 2048, 2048, 4),
        "3B": (28, 24, 3072, 2048, 4),
    },
    "cpu": {"tiny": TINY, "small": (2, 4, 128, 128, 8)},
}
PROFILED = (10, 2)
"""The profiler's window (shardwise's default `tracking.profile_step`, `profile_steps`)."""
TARGETS = (
    "targets: GPU tokens/s ratio >= 0.99 eager and compiled; CPU proxy: step <= hand + 0.5 ms, "
    "operators <= 1.05x the hand loop's, no host read between log steps"
)


def shardwise_cmd(sets: list[str], compiled: bool, run_dir: Path, threads: int) -> list[str]:
    extra = [f"train.compile={str(compiled).lower()}", f"job.run_dir={run_dir}"]
    if threads:
        extra.append(f"job.threads_per_rank={threads}")
    flags = [a for s in [*sets, *extra] for a in ("--set", s)]
    return [str(BIN / "shardwise"), "train", str(JOB), "--nproc", "1", *flags]


def hand_cmd(
    sets: list[str], compiled: bool, counts: Path, threads: int, float8: str = ""
) -> list[str]:
    flags = [a for s in sets for a in ("--set", s)]
    return [
        sys.executable,
        str(Path(__file__).with_name("hand_loop.py")),
        *(["--compiled"] if compiled else []),
        *(["--float8", float8] if float8 else []),
        "--counts",
        str(counts),
        *(["--threads", str(threads)] if threads else []),
        *flags,
    ]


def flops_per_token(size: tuple[int, int, int, int, int]) -> float:
    from shardwise.models.gpt import build_gpt
    from shardwise.training.job_names import LOSSES
    from shardwise.training.trainer.flops import count_flops, meta_batch

    layers, heads, hidden, seq, micro = size
    with torch.device("meta"):
        model = build_gpt(layers=layers, heads=heads, hidden=hidden, seq_len=seq)
    tokens = torch.zeros(seq, dtype=torch.long)
    flops = count_flops(model, LOSSES["cross_entropy"], *meta_batch((tokens, tokens), micro))
    return flops / (seq * micro)


def measure(
    label: str, size: tuple, args: argparse.Namespace, kind: str, tmp: Path
) -> dict[str, dict]:
    """Every contender's step times, and the counts of each run, over the repeats."""
    precision = "bf16" if kind == "cuda" else "fp32"
    sets = job_sets(size, precision, args.steps)
    threads = 0 if kind == "cuda" else 1
    if args.float8:
        return _float8(label, sets, args, kind, tmp)
    modes = [False] if args.no_compile else [False, True]
    found: dict[str, dict] = {}
    for repeat in range(args.repeats):
        for compiled in modes:  # interleaved: shardwise, hand, shardwise, hand, …
            mode = "compiled" if compiled else "eager"
            run_dir = tmp / f"{label}-{mode}-{repeat}"
            counts = tmp / f"{label}-hand-{mode}-{repeat}.json"
            contenders = [
                ("shardwise", shardwise_cmd(sets, compiled, run_dir, threads)),
                ("hand loop", hand_cmd(sets, compiled, counts, threads)),
            ]
            if args.unprofiled and not compiled:
                unprofiled = [*sets, "tracking.profile_step=0"]
                bare = tmp / f"{label}-unprofiled-{repeat}"
                command = shardwise_cmd(unprofiled, False, bare, threads)
                contenders.append(("shardwise, no profile window", command))
            for who, cmd in contenders:
                per_step, _ = timed(cmd, args.warmup, args.steps)
                entry = found.setdefault(f"{who} {mode}", {"times": [], "profiles": []})
                entry["times"].append(per_step)
                source = run_dir / "profile" / "rank0.json" if who == "shardwise" else counts
                if source.exists() and who != "shardwise, no profile window":
                    entry["profiles"].append(json.loads(source.read_text()))
                print(f"  {label} repeat {repeat + 1}: {who} {mode} {per_step * 1e3:.2f} ms/step")
    return found


def _float8(
    label: str, sets: list[str], args: argparse.Namespace, kind: str, tmp: Path
) -> dict[str, dict]:
    """Compiled, bf16 against float8 (`args.float8`'s recipe), shardwise and the hand loop,
    interleaved; on a CPU in torchao's emulation, the GPT's linears named (too small for
    `auto`)."""
    float8 = [f"train.float8={args.float8}"]
    if kind == "cpu":
        float8 += ["train.float8_emulate=true", 'train.float8_layers=["*.mlp.*","*.attn.*"]']
    threads = 0 if kind == "cuda" else 1
    base = "bf16" if kind == "cuda" else "fp32"  # float8's weights and the rest of the model
    found: dict[str, dict] = {}
    for repeat in range(args.repeats):
        for precision in (base, "float8"):
            extra = float8 if precision == "float8" else []
            run_dir = tmp / f"{label}-{precision}-{repeat}"
            counts = tmp / f"{label}-hand-{precision}-{repeat}.json"
            contenders = [
                ("shardwise", shardwise_cmd([*sets, *extra], True, run_dir, threads)),
                (
                    "hand loop",
                    hand_cmd([*sets, *extra], True, counts, threads, args.float8 if extra else ""),
                ),
            ]
            for who, cmd in contenders:
                per_step, _ = timed(cmd, args.warmup, args.steps)
                found.setdefault(f"{who} {precision}", {"times": [], "profiles": []})
                found[f"{who} {precision}"]["times"].append(per_step)
                print(
                    f"  {label} repeat {repeat + 1}: {who} {precision} {per_step * 1e3:.2f} ms/step"
                )
    for who in ("shardwise", "hand loop"):
        plain, f8 = found[f"{who} {base}"]["times"], found[f"{who} float8"]["times"]
        ratios = [b / f for b, f in zip(plain, f8, strict=True)]
        print(
            f"  {label}: {who} tokens/s float8 / {base}, compiled: median "
            f"{statistics.median(ratios):.3f} (spread {min(ratios):.3f}-{max(ratios):.3f})",
            flush=True,
        )
    return found


def counted(profiles: list[dict]) -> dict[str, float]:
    """Medians over the repeats of a contender's per-step counts (steps between log steps)."""
    from shardwise.training.trainer.profile import summarise

    if not profiles:
        return {}
    each = [summarise(p["steps"]) for p in profiles]
    out = {k: statistics.median(e[k] for e in each) for k in each[0] if k != "phases"}
    phases = {name for e in each for name in e["phases"]}
    out |= {
        f"phase {name}": statistics.median(e["phases"].get(name, 0.0) for e in each)
        for name in phases
    }
    reads = [r for p in profiles for r in p.get("host_reads", []) if not r["reporting"]]
    if reads:
        out["host reads"] = max(r["count"] for r in reads)
        out["where"] = sorted({w for r in reads for w in r["where"]})  # type: ignore[assignment]
    return out


def report(label: str, size: tuple, found: dict[str, dict], peak: Peak, kind: str) -> None:
    tokens = size[3] * size[4]
    per_token = flops_per_token(size)
    layers, _, hidden, seq, micro = size
    print(f"\nGPT {label}: layers {layers}, hidden {hidden}, seq {seq}, micro batch {micro}")
    for contender, entry in found.items():
        values = entry["times"]
        step = statistics.median(values)
        rate = tokens / step
        mfu = peak.mfu_text(rate * per_token)
        print(
            f"  {contender:<32} {step * 1e3:8.2f} ms/step ({min(values) * 1e3:.2f}-"
            f"{max(values) * 1e3:.2f})  {rate:10,.0f} tokens/s  {mfu}"
        )
    for mode in ("eager", "compiled"):
        ours, hand = found.get(f"shardwise {mode}"), found.get(f"hand loop {mode}")
        if not ours or not hand:
            continue
        pairs = list(zip(ours["times"], hand["times"], strict=True))
        ratios = [h / s for s, h in pairs]
        extra = [(s - h) * 1e3 for s, h in pairs]
        print(
            f"  {mode}: tokens/s shardwise / hand loop median {statistics.median(ratios):.3f} "
            f"(spread {min(ratios):.3f}-{max(ratios):.3f}); shardwise's overhead "
            f"{statistics.median(extra):+.2f} ms/step (spread {min(extra):+.2f}-{max(extra):+.2f})"
        )
        a, b = counted(ours["profiles"]), counted(hand["profiles"])
        if a and b:
            line = (
                f"    operators per step {a['operators']:.0f} vs {b['operators']:.0f} "
                f"({a['operators'] / max(b['operators'], 1):.3f}x)"
            )
            if kind == "cuda":
                line += f"; kernels {a['kernels']:.0f} vs {b['kernels']:.0f}"
            line += f"; syncs (profiler) {a['syncs']:.0f} vs {b['syncs']:.0f}"
            if mode == "compiled":
                line += (
                    f"; compiled regions {a['compiled_regions']:.0f} vs "
                    f"{b['compiled_regions']:.0f}, operators outside them "
                    f"{a['operators_outside']:.0f} vs {b['operators_outside']:.0f}"
                )
            print(line)
            if "host reads" in a:
                where = f" ({'; '.join(a['where'])})" if a["where"] else ""
                print(f"    host reads between log steps (shardwise): {a['host reads']}{where}")
            phases = {k.removeprefix("phase "): v for k, v in a.items() if k.startswith("phase ")}
            print(
                "    shardwise's phases, ms per profiled step: "
                + ", ".join(f"{k} {v * 1e3:.3f}" for k, v in sorted(phases.items()))
            )


def planned(size: tuple, kind: str) -> float | None:
    """The planner's step for this size on this machine's calibrated profile (None without
    one, or one of another device)."""
    from shardwise.common.devices import device_name
    from shardwise.plan.hardware import THIS_MACHINE, UnknownHardware, lookup
    from shardwise.plan.layout import PRECISIONS, Layout
    from shardwise.plan.model import Transformer
    from shardwise.plan.timing import step_time

    try:
        hardware = lookup(THIS_MACHINE)
    except UnknownHardware:
        return None
    if hardware.device != device_name(torch.device(kind)):
        return None
    layers, heads, hidden, seq, micro = size
    model = Transformer(layers=layers, hidden=hidden, heads=heads, vocab=256, seq=seq)
    precision = PRECISIONS["bf16-autocast" if kind == "cuda" else "fp32"]
    return step_time(model, Layout(micro_batch=micro), precision, hardware).total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=None, help="default 3 GPU, 5 CPU")
    parser.add_argument("--sizes", nargs="+", default=None, help="names from SIZES")
    parser.add_argument("--steps", type=int, default=None, help="per run")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--no-compile", action="store_true", help="eager contenders only")
    parser.add_argument(
        "--float8",
        default="",
        help="a recipe (tensorwise, rowwise): bf16 against float8, compiled (issue 60's sizes: "
        "1.2B-2k 3B)",
    )
    parser.add_argument(
        "--unprofiled",
        action="store_true",
        help="also time shardwise with tracking.profile_step = 0 (what its profile window costs)",
    )
    args = parser.parse_args()
    from shardwise.training.trainer.flops import measure_peak

    kind = "cuda" if torch.cuda.is_available() else "cpu"
    args.repeats = args.repeats or (3 if kind == "cuda" else 5)
    # the clock starts after compiling (step 1) and shardwise's profile and read windows (10-13)
    args.warmup = args.warmup or (20 if kind == "cuda" else 50)
    args.steps = args.steps or (args.warmup + (40 if kind == "cuda" else 250))
    if kind == "cpu":
        torch.set_num_threads(1)
    peak = measure_peak(torch.device(kind), torch.bfloat16 if kind == "cuda" else torch.float32)
    name = torch.cuda.get_device_name() if kind == "cuda" else f"{os.cpu_count()} CPU cores"
    threads = "" if kind == "cuda" else "; one process, one thread each"
    print(f"{name}; torch {torch.__version__}{threads}; {peak.describe()}")
    print(TARGETS)
    default = ["86M", "1.2B"] if kind == "cuda" else ["tiny"]
    for label in args.sizes or default:
        size = SIZES[kind][label]
        with tempfile.TemporaryDirectory() as tmp:
            found = measure(label, size, args, kind, Path(tmp))
        report(label, size, found, peak, kind)
        predicted = planned(size, kind)
        hand = found.get("hand loop eager")
        if predicted is not None and hand:
            measured = statistics.median(hand["times"])
            print(
                f"  planner on this machine's calibrated profile: {predicted * 1e3:.1f} ms/step "
                f"against the hand loop's {measured * 1e3:.1f} ms: {predicted / measured:.2f}x "
                "(target 0.85-1.15)"
            )


if __name__ == "__main__":
    main()
