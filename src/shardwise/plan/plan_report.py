"""What `shardwise plan` prints: the ranked layouts as a rich table with the winner explained and
the run's figures, or the same as JSON (`--json`); a calibrated profile in one line."""

from __future__ import annotations

import sys
from dataclasses import asdict
from typing import Any

from shardwise.plan import hardware as hw
from shardwise.plan.link_report import modes_json, render_modes
from shardwise.plan.model import describe
from shardwise.plan.search import (
    Candidate,
    Plan,
    explain,
    gib,
    seconds,
)
from shardwise.plan.timing import achieved_utilisation


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
