"""The options of `shardwise plan` (plan_command.py runs it): every numeric flag with its range,
every flag of a few options, and their checks, which make a mistake one line naming the flag."""

from __future__ import annotations

import argparse
from typing import Any

from shardwise.common.arguments import add_debug
from shardwise.common.errors import ConfigError
from shardwise.plan import hardware as hw
from shardwise.plan.bounds import Bound, one_of
from shardwise.plan.layout import OPTIMIZERS, PRECISIONS, RECOMPUTE
from shardwise.plan.network import LINK_GBPS, parse_link

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
