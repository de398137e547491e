"""`shardwise plan`: arguments, the model and hardware they describe, and the report (a rich
table, `--json`, `--chart`)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from typing import Any

from shardwise.common.arguments import add_debug
from shardwise.common.errors import ConfigError
from shardwise.plan import hardware as hw
from shardwise.plan.bounds import Bound, one_of
from shardwise.plan.chart import chart_path
from shardwise.plan.comm_modes import job_mode
from shardwise.plan.layout import OPTIMIZERS, PRECISIONS, RECOMPUTE
from shardwise.plan.link_report import modes_json, render_modes
from shardwise.plan.model import Transformer, describe, divisors, shape_for
from shardwise.plan.network import LINK_GBPS, parse_link
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
from shardwise.plan.timing import achieved_utilisation

DEVICES = 2**20
"""The most devices (and any one parallel degree) planned for: past the largest clusters built,
and small enough that the search, which enumerates divisors of the device count, takes seconds."""

NUMBERS: dict[str, Bound] = {
    "layers": Bound(1, 10_000, whole=True),
    "hidden": Bound(1, 2**20, whole=True),
    "heads": Bound(1, 2**20, whole=True),
    "vocab": Bound(1, 10**8, whole=True),
    "seq": Bound(1, 10**8, whole=True, means="tokens per sequence"),
    "ffn": Bound(1, 2**24, whole=True, means="the MLP's inner size; leave it out for 4 × hidden"),
    "params": Bound(1, 1e15, means="a parameter count, e.g. 7e9"),
    "gpus": Bound(1, DEVICES, whole=True),
    "nproc": Bound(1, DEVICES, whole=True),
    "gpus_per_node": hw.FIELDS["gpus_per_node"],
    "memory_gib": Bound(0, 2**20, above=True, means="GiB per device"),
    "peak_tflops": Bound(0, 1e6, above=True, means="dense 16-bit TFLOP/s per device"),
    "utilisation": hw.FIELDS["utilisation"],
    "intra_gbs": Bound(0, 1e6, above=True, means="GB/s per device"),
    "inter_gbs": Bound(0, 1e6, above=True, means="GB/s per device"),
    "link": LINK_GBPS,
    "global_batch": Bound(1, 10**8, whole=True, means="sequences per step"),
    "tokens": Bound(1, 1e18, means="tokens to train on, e.g. 300e9"),
    "dp": Bound(1, DEVICES, whole=True),
    "tp": Bound(1, DEVICES, whole=True),
    "pp": Bound(1, DEVICES, whole=True),
    "zero": Bound(0, 3, whole=True, means="the ZeRO stage"),
    "micro_batch": Bound(1, 10**8, whole=True),
    "top": Bound(1, 1_000, whole=True, means="layouts to list"),
}
"""Every numeric flag and its range. argparse keeps them as typed; `check_arguments` turns each
into its number, so that a bad one (text, NaN, out of range) is a `ConfigError` naming the flag
and what it allows, as every other mistake in a plan is. `--link GBPS[,LATENCY_MS]` is two
numbers: its bound is the bandwidth's, and `network.parse_link` reads both."""

CHOICES: dict[str, tuple[str, ...]] = {
    "model": ("gpt",),
    "precision": tuple(sorted(PRECISIONS)),
    "optimizer": OPTIMIZERS,
    "attention": ("fused", "unfused"),
    "recompute": RECOMPUTE,
}
"""Every flag that names one of a few options (checked by `check_arguments`, likewise)."""

MODEL_FLAGS = (
    *("model", "layers", "hidden", "heads", "vocab", "seq", "ffn", "params"),
    *("attention", "no_dropout", "gpus"),
)
"""What describes the model and its devices without a job file (a job file has its own)."""


def add_arguments(plan: argparse.ArgumentParser) -> None:
    plan.add_argument("job", nargs="?", help="a job file: plan its own model (and layout)")
    model = plan.add_argument_group("model (a transformer shape, a parameter count, or a job)")
    _choice(model, "--model", help="the model (decoder-only)")
    for name in ("layers", "hidden", "heads", "vocab", "seq", "ffn"):
        _number(model, f"--{name}")
    _number(model, "--params", help="a bare parameter count, e.g. 7e9")
    where = plan.add_argument_group("devices and hardware")
    _number(where, "--gpus", help="devices in the job")
    _number(where, "--nproc", help="with a job file: its ranks (default 1)")
    _number(where, "--gpus-per-node")
    where.add_argument(
        "--hardware",
        help=f"{', '.join(hw.PRESETS)}, {hw.THIS_MACHINE} (calibrated), or a .toml file",
    )
    _number(where, "--memory-gib", help="override: memory per device")
    _number(where, "--peak-tflops", help="override: dense 16-bit peak")
    _number(
        where,
        "--utilisation",
        help="override: fraction of peak every layer achieves, in (0, 1] (a flat rate, in "
        "place of the curve by layer size)",
    )
    _number(where, "--intra-gbs", help="override: GB/s per device in a node")
    _number(where, "--inter-gbs", help="override: GB/s per device across nodes")
    _number(
        where,
        "--link",
        metavar="GBPS[,LATENCY_MS]",
        help="the network between nodes: Gbit/s each direction, and optionally its one-way "
        "latency in ms; compares the data-parallel communication modes on it",
    )
    run = plan.add_argument_group("the run")
    _number(run, "--global-batch", help="sequences per step (default 4 per device)")
    _number(run, "--tokens", help="tokens to train on, e.g. 300e9")
    _choice(run, "--precision", help="default bf16")
    _choice(run, "--optimizer", help="default adamw")
    _choice(run, "--attention", help="default fused")
    run.add_argument("--no-dropout", action="store_true")
    fixed = plan.add_argument_group("fix part of the layout (the search chooses the rest)")
    for name in ("dp", "tp", "pp"):
        _number(fixed, f"--{name}")
    _number(fixed, "--zero", metavar="{0,1,2,3}")
    _number(fixed, "--micro-batch")
    _choice(fixed, "--recompute")
    fixed.add_argument("--offload", action="store_true", help="ZeRO-Offload optimizer states")
    out = plan.add_argument_group("output")
    _number(out, "--top", default=10, help="layouts to list (default 10)")
    out.add_argument("--json", action="store_true", help="print the plan as JSON")
    out.add_argument(
        "--chart",
        metavar="PNG",
        help="write a chart of time and memory per layout, the first 50 at most (.png, .svg, "
        ".pdf, .jpg)",
    )
    out.add_argument(
        "--calibrate", action="store_true", help="measure this machine and save its profile"
    )
    add_debug(out)


def _number(group: Any, flag: str, **kwargs: Any) -> None:
    """A flag of NUMBERS: argparse keeps its text (type=str), `check_arguments` the number."""
    assert flag[2:].replace("-", "_") in NUMBERS, flag
    group.add_argument(flag, type=str, **kwargs)


def _choice(group: Any, flag: str, **kwargs: Any) -> None:
    """A flag of CHOICES, its options shown in the usage; `check_arguments` checks it."""
    options = CHOICES[flag[2:].replace("-", "_")]
    group.add_argument(flag, metavar="{" + ",".join(options) + "}", **kwargs)


def check_arguments(args: argparse.Namespace) -> None:
    """Each numeric flag given turned into its number, in range, each option one of its choices,
    and no flag that the rest of the command line would ignore; `ConfigError` naming the flag
    otherwise."""
    for dest, bound in NUMBERS.items():
        value = getattr(args, dest)
        if isinstance(value, str):
            number = parse_link(value) if dest == "link" else bound.parse(value, _flag(dest))
            setattr(args, dest, number)
    if args.link is not None and args.inter_gbs is not None:
        raise ConfigError(
            "--link and --inter-gbs both set the network between nodes; give one of them"
        )
    for dest, options in CHOICES.items():
        if getattr(args, dest) is not None:
            one_of(getattr(args, dest), options, _flag(dest))
    if args.job:
        given = [_flag(dest) for dest in MODEL_FLAGS if getattr(args, dest) not in (None, False)]
        if given:
            raise ConfigError(
                f"{given[0]} is for planning without a job file; {args.job} has its own model "
                "and devices (give its ranks with --nproc N), or leave out the job file"
            )
    elif args.nproc is not None:
        raise ConfigError("--nproc N is a job file's ranks; without a job file give --gpus N")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def run(args: argparse.Namespace) -> int:
    check_arguments(args)
    if args.calibrate:
        profile = _calibrate(args)
        path = hw.save_profile(profile)
        print(f"saved {path}: {summary_of(profile)}")
        return 0
    chart = None if args.chart is None else chart_path(args.chart)  # before the plan prints
    plan, own = make_plan(args)
    if args.json:
        print(json.dumps(to_json(plan, own, args.top), indent=2))
    else:
        render(plan, own, args.top)
    if chart is not None:
        from shardwise.plan.chart import write_chart

        write_chart(plan, chart, top=args.top)
        print(f"chart: {args.chart}", file=sys.stderr if args.json else sys.stdout)
    return 0


def make_plan(args: argparse.Namespace) -> tuple[Plan, Candidate | None]:
    """The plan the arguments ask for, and (for a job file) the job's own layout evaluated."""
    hardware = _hardware(args)
    dropout, fused = not args.no_dropout, args.attention != "unfused"
    traced, planned = None, None
    if args.job:
        from shardwise.plan.job import plan_job
        from shardwise.training.config.load import load_config

        planned = plan_job(load_config(args.job, []), args.nproc or 1, hardware)
        model = planned.model
        precision = PRECISIONS[args.precision] if args.precision else planned.precision
        optimizer = args.optimizer or planned.optimizer
        devices = args.nproc or 1
        global_batch = args.global_batch or planned.layout.global_batch
        dropout, fused, traced = planned.dropout, planned.fused_attention, planned.traced
    else:
        model = _model(args)
        precision = PRECISIONS[args.precision or "bf16"]
        optimizer = args.optimizer or "adamw"
        if args.gpus is None:
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
    plan.network = args.link
    own = None
    if planned is not None:
        own = plan.evaluate(planned.layout)
        plan.tensors = planned.tensors
        if planned.mode is not None:
            plan.job_mode = job_mode(
                planned.mode, auto=planned.hierarchical_auto, layout=own.layout, hardware=hardware
            )
    if plan.best is None and not args.json:
        lines = explain(plan)
        raise ConfigError(
            f"{describe(model)} fits no layout on {devices} × {hardware.name}: "
            f"{lines[0].removeprefix('nothing fits: ')}; {lines[1]}"
        )
    return plan, own


def _calibrate(args: argparse.Namespace) -> hw.Hardware:
    """This machine's GPUs where CUDA sees any (at the job's layer and micro-batch, where a job
    file is given), else its CPU cores."""
    import torch

    def progress(line: str) -> None:
        print(line, file=sys.stderr)

    if not torch.cuda.is_available():
        from shardwise.plan.calibrate import calibrate

        return calibrate(progress=progress)
    from shardwise.plan.calibrate import LayerShape
    from shardwise.plan.calibrate_gpu import calibrate_gpu

    shape = None
    if args.job:
        from shardwise.plan.job import plan_job
        from shardwise.training.config.load import load_config

        planned = plan_job(load_config(args.job, []), args.nproc or 1)
        model = planned.model
        shape = LayerShape(model.hidden, model.heads, model.seq, planned.layout.micro_batch)
    return calibrate_gpu(shape, progress=progress)


def _hardware(args: argparse.Namespace) -> hw.Hardware:
    name = args.hardware or (hw.THIS_MACHINE if args.job else None)
    if name is None:
        raise ConfigError(
            f"--hardware NAME: one of {', '.join(hw.PRESETS)}, {hw.THIS_MACHINE}, or a .toml "
            "file of fields"
        )
    hardware = hw.with_overrides(
        hw.lookup(name),
        memory=_times(args.memory_gib, hw.GiB),
        peak_flops=_times(args.peak_tflops, 1e12),
        utilisation=args.utilisation,
        layer_overhead=None if args.utilisation is None else 0.0,
        intra_bandwidth=_times(args.intra_gbs, 1e9),
        inter_bandwidth=_times(args.inter_gbs, 1e9),
        gpus_per_node=args.gpus_per_node,
    )
    return hardware if args.link is None else args.link.apply(hardware)


def _times(value: float | None, unit: float) -> float | None:
    return None if value is None else value * unit


def _model(args: argparse.Namespace) -> Transformer:
    shape = [args.layers, args.hidden, args.heads]
    if args.params is not None and shape == [None] * 3:
        if args.ffn is not None:
            raise ConfigError("--ffn goes with a shape: --layers L --hidden H --heads A --ffn F")
        return shape_for(args.params, seq=args.seq or 2048, vocab=args.vocab or 32_000)
    if None in shape:
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
    if args.params is not None:
        model = replace(model, measured_params=int(args.params))
    return model


def _nearest_divisor(n: int, near: int) -> int:
    return min(divisors(n), key=lambda d: abs(d - near))


def summary_of(profile: hw.Hardware) -> str:
    return (
        f"{_flops(profile.peak_flops)} per device (a core on a CPU); in a transformer layer "
        f"{_curve(profile)}; memory {profile.memory_bandwidth / 1e9:.1f} GB/s, all-reduce "
        f"latency {profile.intra_latency * 1e6:.0f} µs and bandwidth "
        f"{profile.intra_bandwidth / 1e9:.2f} GB/s, a tensor-parallel layer at "
        f"{profile.tensor_parallel_efficiency:.0%} of the layer's rate"
    )


def _curve(hardware: hw.Hardware) -> str:
    large = f"large layers at {hardware.utilisation:.0%} of it"
    if not hardware.layer_overhead:
        return f"every layer at {hardware.utilisation:.0%} of it"
    return f"{large} + {hardware.layer_overhead * 1e3:.2f} ms per layer and micro-batch"


def _flops(rate: float) -> str:
    return f"{rate / 1e12:.0f} TFLOP/s" if rate >= 1e12 else f"{rate / 1e9:.1f} GFLOP/s"


def render(plan: Plan, own: Candidate | None, top: int) -> None:
    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 150)
    console.print(f"model: {describe(plan.model)}")
    console.print(
        f"devices: {plan.devices} × {plan.hardware.name} ({gib(plan.hardware.memory)}, "
        f"{_flops(plan.hardware.peak_flops)} peak, {_curve(plan.hardware)}, "
        f"{plan.hardware.gpus_per_node} per node); precision {plan.precision.name}, "
        f"{plan.optimizer}; global batch {plan.global_batch} × {plan.model.seq} tokens"
    )
    console.print(_ranked_table(plan, own, top))
    for line in explain(plan):
        console.print(f"- {line}")
    for line in _run_lines(plan):
        console.print(f"- {line}")
    chosen = own or plan.best
    if plan.network and chosen is not None:
        render_modes(console, plan, chosen, job=own is not None)


def _ranked_table(plan: Plan, own: Candidate | None, top: int) -> Any:
    from rich.table import Table

    table = Table(title=f"{len(plan.ranked)} layouts fit, {len(plan.dropped)} do not")
    for column in ("layout", "step", "compute", "bubble", "tp comm", "dp comm", "memory/dev"):
        table.add_column(column, justify="left" if column == "layout" else "right")
    if plan.tokens:
        table.add_column("run", justify="right")
    if plan.network:
        table.add_column("fastest sync (--link)", justify="right")
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
        if plan.network:
            fastest = plan.comm_modes(c).fastest()
            cells.append(f"{fastest.mode.name()}, {seconds(fastest.step)}" if fastest else "-")
        table.add_row(*cells)
    return table


def _run_lines(plan: Plan) -> list[str]:
    lines = []
    best = plan.best
    if best is not None:
        run = plan.run_seconds(best)
        speed = f"speedup over one device: {plan.speedup(best):.1f}x"
        if run is not None:
            lines.append(
                f"whole run: {plan.tokens:.3g} tokens = {plan.steps():,.0f} steps, "
                f"{seconds(run)}; {speed}"
            )
        else:
            lines.append(f"{speed} (add --tokens N for the whole run)")
    if plan.dropped:
        lines.append(
            f"dropped, smallest first: {plan.dropped[0].layout.name()} — {plan.dropped[0].reason}"
        )
    return lines


def to_json(plan: Plan, own: Candidate | None, top: int) -> dict[str, Any]:
    def candidate(c: Candidate) -> dict[str, Any]:
        return {
            "layout": {**asdict(c.layout), "name": c.layout.name()},
            "fits": c.fits,
            "reason": c.reason,
            "step_seconds": c.time.total,
            "utilisation": achieved_utilisation(plan.model, c.layout, plan.hardware),
            "time": {**c.time.terms(), "data-parallel comm (total)": c.time.data_parallel},
            "memory_bytes": c.memory.as_dict(),
            "run_seconds": plan.run_seconds(c),
            "speedup": plan.speedup(c),
        } | ({"comm_modes": modes_json(plan.comm_modes(c))} if plan.network else {})

    network = plan.network
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
        "link": None
        if network is None
        else {
            **asdict(network),
            "bandwidth_bytes_per_s": plan.hardware.inter_bandwidth,
            "latency_s": plan.hardware.inter_latency,
        },
        "job_mode": plan.job_mode.name() if plan.job_mode else None,
        "job_layout": candidate(own) if own else None,
        "ranked": [candidate(c) for c in plan.ranked[:top]],
        "dropped": [candidate(c) for c in plan.dropped[:top]],
        "explanation": explain(plan),
    }
