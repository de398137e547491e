"""The `--link` part of `shardwise plan`'s report: the data-parallel communication modes compared
on a layout (comm_modes.py), as a table with its assumptions, and as JSON."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from shardwise.plan.comm_modes import Comparison, ModeCost
from shardwise.plan.search import Candidate, Plan, seconds


def render_modes(console: Any, plan: Plan, chosen: Candidate, *, job: bool) -> None:
    """The communication modes compared on `chosen`'s layout (the job's, or the fastest) and the
    network (--link)."""
    from rich.table import Table

    assert plan.network is not None
    found = plan.comm_modes(chosen)
    where = found.placement
    which = "the job's layout" if job else "the fastest layout"
    console.print(
        f"data-parallel communication of {which}, {chosen.layout.name()}: {where.ranks} ranks "
        f"on {where.nodes} node(s) × {where.per_node}, the network {plan.network.describe()}"
    )
    table = Table()
    for column in ("mode", "rank 0 sends", "node sends across", "comm", "step", "step ÷ ddp's"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    base = found.baseline
    for cost in (c for c in found.costs if c.applies):
        mine = job and plan.job_mode is not None and cost.mode.name() == plan.job_mode.name()
        own = " (the job's)" if mine else ""
        ratio = f"{cost.step / base.step:.2f}" if base.applies else "-"
        table.add_row(
            cost.mode.name() + own, _bytes(cost.sent), _bytes(cost.across),
            seconds(cost.comm), seconds(cost.step), ratio,
        )  # fmt: skip
    console.print(table)
    for line in modes_notes(plan, found, job=job):
        console.print(f"- {line}")


def modes_notes(plan: Plan, found: Comparison, *, job: bool) -> list[str]:
    """What the modes table assumes, what does not apply, and which mode is fastest."""
    lines = []
    if job and plan.job_mode is None:
        lines.append("the job's own train.sync is not a mode the planner models")
    if found.placement.nodes == 1:
        lines.append("every data-parallel rank is on one node: the network is not crossed")
    hidden = plan.hardware.overlap
    lines.append(
        f"overlap: every every-step mode's collectives hide behind backward up to the "
        f"hardware's overlap ({hidden:.0%} of it here; the compression and hierarchical hooks on "
        "shardwise's communication thread), a codec's own work does not; local SGD and DiLoCo "
        "synchronise after the optimizer step: none of theirs hides; an async worker pushes and "
        "pulls after its backward, and rank 0's server sends and receives one worker at a time"
    )
    skipped: dict[str, list[str]] = {}
    for cost in found.costs:
        if not cost.applies:
            skipped.setdefault(cost.why_not, []).append(cost.mode.name())
    for why, names in skipped.items():
        lines.append(f"not for this layout: {', '.join(names)} ({why})")
    fastest = found.fastest()
    if fastest is not None and found.baseline.applies:
        lines.append(
            f"fastest: {fastest.mode.name()}, {seconds(fastest.step)} per step, "
            f"{found.baseline.step / fastest.step:.2f}× ddp's speed (loss per step may differ: "
            "compression and fewer synchronisations change the updates)"
        )
    return lines


def _bytes(value: float) -> str:
    if value >= 1e9:
        return f"{value / 1e9:.2f} GB"
    if value >= 1e6:
        return f"{value / 1e6:.2f} MB"
    return f"{value / 1e3:.1f} kB" if value else "0"


def modes_json(found: Comparison) -> dict[str, Any]:
    """The modes compared on one layout: where its data-parallel ranks sit, and per mode its
    bytes and seconds per step (None where the mode does not apply)."""
    base = found.baseline

    def row(cost: ModeCost) -> dict[str, Any]:
        numbers: dict[str, Any] = {
            "bytes_per_step": cost.sent,
            "inter_node_bytes_per_step": cost.across,
            "comm_seconds": cost.comm,
            "exposed_seconds": cost.exposed,
            "step_seconds": cost.step,
            "step_vs_ddp": cost.step / base.step if base.applies else None,
            "bytes_vs_ddp": cost.sent / base.sent if base.applies and base.sent else None,
        }
        if not cost.applies:
            numbers = dict.fromkeys(numbers)
        return {
            "mode": cost.mode.name(),
            "settings": asdict(cost.mode),
            "why_not": cost.why_not or None,
            **numbers,
        }

    where = found.placement
    return {
        "data_parallel_ranks": where.ranks,
        "ranks_per_node": where.per_node,
        "nodes": where.nodes,
        "modes": [row(cost) for cost in found.costs],
    }
