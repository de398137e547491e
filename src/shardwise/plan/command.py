"""`shardwise plan`: arguments, the model and hardware they describe, and the report (a rich
table, `--json`, `--chart`)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from shardwise.config import ConfigError
from shardwise.plan import hardware as hw
from shardwise.plan.layout import OPTIMIZERS, PRECISIONS, RECOMPUTE
from shardwise.plan.model import Transformer, describe, shape_for
from shardwise.plan.search import (
    Candidate,
    Constraints,
    NoLayout,
    Plan,
    explain,
    gib,
    search,
    seconds,
)


def add_arguments(plan: argparse.ArgumentParser) -> None:
    plan.add_argument("job", nargs="?", help="a job file: plan its own model (and layout)")
    model = plan.add_argument_group("model (a transformer shape, a parameter count, or a job)")
    model.add_argument("--model", choices=["gpt"], help="the model family (decoder-only)")
    for name in ("layers", "hidden", "heads", "vocab", "seq", "ffn"):
        model.add_argument(f"--{name}", type=int)
    model.add_argument("--params", type=float, help="a bare parameter count, e.g. 7e9")
    where = plan.add_argument_group("devices and hardware")
    where.add_argument("--gpus", type=int, help="devices in the job")
    where.add_argument("--nproc", type=int, help="with a job file: its ranks (default 1)")
    where.add_argument("--gpus-per-node", type=int)
    where.add_argument(
        "--hardware",
        help=f"{', '.join(hw.PRESETS)}, {hw.THIS_MACHINE} (calibrated), or a .toml file",
    )
    where.add_argument("--memory-gib", type=float, help="override: memory per device")
    where.add_argument("--peak-tflops", type=float, help="override: dense 16-bit peak")
    where.add_argument("--utilisation", type=float, help="override: fraction of peak achieved")
    where.add_argument("--intra-gbs", type=float, help="override: GB/s per device in a node")
    where.add_argument("--inter-gbs", type=float, help="override: GB/s per device across nodes")
    run = plan.add_argument_group("the run")
    run.add_argument("--global-batch", type=int, help="sequences per step (default 4 per device)")
    run.add_argument("--tokens", type=float, help="tokens to train on, e.g. 300e9")
    run.add_argument("--precision", choices=sorted(PRECISIONS), help="default bf16")
    run.add_argument("--optimizer", choices=OPTIMIZERS, help="default adamw")
    run.add_argument("--attention", choices=["fused", "unfused"], default="fused")
    run.add_argument("--no-dropout", action="store_true")
    fixed = plan.add_argument_group("fix part of the layout (the search chooses the rest)")
    fixed.add_argument("--dp", type=int)
    fixed.add_argument("--tp", type=int)
    fixed.add_argument("--pp", type=int)
    fixed.add_argument("--zero", type=int, choices=[0, 1, 2, 3])
    fixed.add_argument("--micro-batch", type=int)
    fixed.add_argument("--recompute", choices=RECOMPUTE)
    fixed.add_argument("--offload", action="store_true", help="ZeRO-Offload optimizer states")
    out = plan.add_argument_group("output")
    out.add_argument("--top", type=int, default=10, help="layouts to list (default 10)")
    out.add_argument("--json", action="store_true", help="print the plan as JSON")
    out.add_argument("--chart", metavar="PNG", help="write a chart of time and memory per layout")
    out.add_argument(
        "--calibrate", action="store_true", help="measure this machine and save its profile"
    )
    out.add_argument("--debug", action="store_true", help="show tracebacks for every error")


def run(args: argparse.Namespace) -> int:
    if args.calibrate:
        from shardwise.plan.calibrate import calibrate

        profile = calibrate(progress=lambda line: print(line, file=sys.stderr))
        path = hw.save_profile(profile)
        print(f"saved {path}: {summary_of(profile)}")
        return 0
    plan, own = make_plan(args)
    if args.json:
        print(json.dumps(to_json(plan, own, args.top), indent=2))
    else:
        render(plan, own, args.top)
    if args.chart:
        from shardwise.plan.chart import write_chart

        write_chart(plan, Path(args.chart), top=args.top)
        print(f"chart: {args.chart}", file=sys.stderr if args.json else sys.stdout)
    return 0


def make_plan(args: argparse.Namespace) -> tuple[Plan, Candidate | None]:
    """The plan the arguments ask for, and (for a job file) the job's own layout evaluated."""
    hardware = _hardware(args)
    own_layout = None
    dropout, fused = not args.no_dropout, args.attention == "fused"
    traced = None
    if args.job:
        from shardwise.config import load_config
        from shardwise.plan.job import plan_job

        planned = plan_job(load_config(args.job, []), args.nproc or 1)
        model, own_layout = planned.model, planned.layout
        precision = PRECISIONS[args.precision] if args.precision else planned.precision
        optimizer = args.optimizer or planned.optimizer
        devices = args.nproc or 1
        global_batch = args.global_batch or own_layout.global_batch
        dropout, fused, traced = planned.dropout, planned.fused_attention, planned.traced
    else:
        model = _model(args)
        precision = PRECISIONS[args.precision or "bf16"]
        optimizer = args.optimizer or "adamw"
        if not args.gpus or args.gpus < 1:
            raise ConfigError("--gpus N: how many devices to plan for (or give a job file)")
        devices = args.gpus
        global_batch = args.global_batch or 4 * devices
    fixed = Constraints(
        dp=args.dp,
        tp=args.tp,
        pp=args.pp,
        zero=args.zero,
        micro_batch=args.micro_batch,
        recompute=args.recompute,
        offload=args.offload,
    )
    try:
        plan = search(
            model,
            hardware,
            precision,
            devices=devices,
            global_batch=global_batch,
            optimizer=optimizer,
            tokens=args.tokens,
            fixed=fixed,
            dropout=dropout,
            fused_attention=fused,
            traced=traced,
        )
    except NoLayout as e:
        raise ConfigError(str(e)) from None
    own = None
    if own_layout is not None:
        own = plan.evaluate(own_layout)
    if plan.best is None and not args.json:
        lines = explain(plan)
        raise ConfigError(
            f"{describe(model)} fits no layout on {devices} × {hardware.name}: "
            f"{lines[0].removeprefix('nothing fits: ')}; {lines[1]}"
        )
    return plan, own


def _hardware(args: argparse.Namespace) -> hw.Hardware:
    name = args.hardware or (hw.THIS_MACHINE if args.job else None)
    if name is None:
        raise ConfigError(
            f"--hardware NAME: one of {', '.join(hw.PRESETS)}, {hw.THIS_MACHINE}, or a .toml "
            "file of fields"
        )
    try:
        base = hw.lookup(name)
    except hw.UnknownHardware as e:
        raise ConfigError(str(e)) from None
    return hw.with_overrides(
        base,
        memory=args.memory_gib * hw.GiB if args.memory_gib else None,
        peak_flops=args.peak_tflops * 1e12 if args.peak_tflops else None,
        utilisation=args.utilisation,
        intra_bandwidth=args.intra_gbs * 1e9 if args.intra_gbs else None,
        inter_bandwidth=args.inter_gbs * 1e9 if args.inter_gbs else None,
        gpus_per_node=args.gpus_per_node,
    )


def _model(args: argparse.Namespace) -> Transformer:
    shape = [args.layers, args.hidden, args.heads]
    if args.params and not any(shape):
        model = shape_for(args.params, seq=args.seq or 2048, vocab=args.vocab or 32_000)
        return model
    if not all(shape):
        raise ConfigError(
            "describe the model: --layers L --hidden H --heads A [--vocab V --seq S], or "
            "--params N, or give a job file"
        )
    if args.hidden % args.heads:
        raise ConfigError(
            f"--hidden {args.hidden} is not a multiple of --heads {args.heads}; try --heads "
            f"{_nearest_divisor(args.hidden, args.heads)}"
        )
    model = Transformer(
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        vocab=args.vocab or 32_000,
        seq=args.seq or 2048,
        ffn=args.ffn or 0,
    )
    if args.params:
        model = replace(model, measured_params=int(args.params))
    return model


def _nearest_divisor(n: int, near: int) -> int:
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: abs(d - near))


def summary_of(profile: hw.Hardware) -> str:
    return (
        f"{profile.peak_flops / 1e9:.1f} GFLOP/s per core ({profile.utilisation:.0%} reached by "
        f"a transformer layer), memory {profile.memory_bandwidth / 1e9:.1f} GB/s, all-reduce "
        f"latency {profile.intra_latency * 1e6:.0f} µs and bandwidth "
        f"{profile.intra_bandwidth / 1e9:.2f} GB/s, a tensor-parallel layer at "
        f"{profile.tensor_parallel_efficiency:.0%} of the layer's rate"
    )


def _flops(rate: float) -> str:
    return f"{rate / 1e12:.0f} TFLOP/s" if rate >= 1e12 else f"{rate / 1e9:.1f} GFLOP/s"


def render(plan: Plan, own: Candidate | None, top: int) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 150)
    console.print(f"model: {describe(plan.model)}")
    console.print(
        f"devices: {plan.devices} × {plan.hardware.name} ({gib(plan.hardware.memory)}, "
        f"{_flops(plan.hardware.peak_flops)} peak at {plan.hardware.utilisation:.0%}, "
        f"{plan.hardware.gpus_per_node} per node); precision {plan.precision.name}, "
        f"{plan.optimizer}; global batch {plan.global_batch} × {plan.model.seq} tokens"
    )
    table = Table(title=f"{len(plan.ranked)} layouts fit, {len(plan.dropped)} do not")
    for column in ("layout", "step", "compute", "bubble", "tp comm", "dp comm", "memory/dev"):
        table.add_column(column, justify="left" if column == "layout" else "right")
    if plan.tokens:
        table.add_column("run", justify="right")
    rows = ([("job", own)] if own else []) + [
        (str(i + 1), c) for i, c in enumerate(plan.ranked[:top])
    ]
    for label, c in rows:
        cells = [
            f"{label}. {c.layout.name()}" + ("" if c.fits else " (does not fit)"),
            seconds(c.time.total),
            seconds(c.time.compute),
            seconds(c.time.bubble),
            seconds(c.time.tensor_parallel),
            seconds(c.time.exposed),
            gib(c.memory.total),
        ]
        if plan.tokens:
            cells.append(seconds(plan.run_seconds(c) or 0))
        table.add_row(*cells)
    console.print(table)
    for line in explain(plan):
        console.print(f"- {line}")
    best = plan.best
    if best is not None:
        run = plan.run_seconds(best)
        speed = f"speedup over one device: {plan.speedup(best):.1f}x"
        if run is not None:
            console.print(
                f"- whole run: {plan.tokens:.3g} tokens = {plan.steps():,.0f} steps, "
                f"{seconds(run)}; {speed}"
            )
        else:
            console.print(f"- {speed} (add --tokens N for the whole run)")
    if plan.dropped:
        console.print(
            f"- dropped, smallest first: {plan.dropped[0].layout.name()} — {plan.dropped[0].reason}"
        )


def to_json(plan: Plan, own: Candidate | None, top: int) -> dict[str, Any]:
    def candidate(c: Candidate) -> dict[str, Any]:
        return {
            "layout": {**asdict(c.layout), "name": c.layout.name()},
            "fits": c.fits,
            "reason": c.reason,
            "step_seconds": c.time.total,
            "time": {**c.time.terms(), "data-parallel comm (total)": c.time.data_parallel},
            "memory_bytes": c.memory.as_dict(),
            "run_seconds": plan.run_seconds(c),
            "speedup": plan.speedup(c),
        }

    return {
        "model": {**asdict(plan.model), "params": plan.model.params},
        "hardware": asdict(plan.hardware),
        "precision": asdict(plan.precision),
        "optimizer": plan.optimizer,
        "devices": plan.devices,
        "global_batch": plan.global_batch,
        "tokens": plan.tokens,
        "steps": plan.steps(),
        "one_device_step_seconds": plan.one_device_step,
        "job_layout": candidate(own) if own else None,
        "ranked": [candidate(c) for c in plan.ranked[:top]],
        "dropped": [candidate(c) for c in plan.dropped[:top]],
        "explanation": explain(plan),
    }
