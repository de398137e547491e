"""`shardwise plan`: the model and hardware the arguments describe (plan_arguments.py), the
layouts searched, and the report (plan_report.py, `--chart`), or `--calibrate`."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from shardwise.common.errors import ConfigError
from shardwise.plan import hardware as hw
from shardwise.plan.chart import chart_path
from shardwise.plan.comm_modes import job_mode
from shardwise.plan.layout import PRECISIONS
from shardwise.plan.model import Transformer, describe, divisors, shape_for
from shardwise.plan.plan_arguments import check_arguments
from shardwise.plan.plan_report import render, summary_of, to_json
from shardwise.plan.search import (
    Candidate,
    Constraints,
    NoLayout,
    Plan,
    explain,
    search,
)


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
