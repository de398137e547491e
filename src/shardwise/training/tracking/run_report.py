"""`shardwise report RUN_DIR`: one self-contained HTML page (and its charts as PNG files) from a
training run's own files, written at the end of every run and logged to MLflow.

It reads what the run wrote: `metrics.jsonl` (loss, evaluation, throughput, MFU, faults),
`summary.json` (memory and pipeline bubble per rank), `profile/rank<r>.json` (where a step's time
went, trainer/profile.py) and `config.toml`. Every chart is drawn only where its data exists
(no bubble chart without a pipeline), and the page says what is missing and why. The PNGs are
embedded in the page as data, so the one file can be mailed or opened anywhere.
"""

from __future__ import annotations

import base64
import html
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardwise.common.console import human_bytes
from shardwise.common.errors import ConfigError
from shardwise.training.tracking.metrics import read_metrics

MIB = 2**20


@dataclass
class Chart:
    title: str
    path: Path
    caption: str


def write_report(run_dir: Path, out: Path | None = None) -> Path:
    """Write `<out>/report.html` and its PNGs (`out` defaults to `<run_dir>/report`); returns
    the page's path."""
    metrics_file = run_dir / "metrics.jsonl"
    if not metrics_file.is_file():
        raise ConfigError(
            f"{run_dir} has no metrics.jsonl: give the run_dir of a shardwise training run "
            "(the job's job.run_dir)"
        )
    import matplotlib

    matplotlib.use("Agg")
    out = out or run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    records = [r for r in read_metrics(metrics_file) if "step" in r]
    summary = _json(run_dir / "summary.json")
    ranks: list[dict[str, Any]] = summary.get("memory", []) if summary else []
    profiles = [_json(p) for p in sorted(run_dir.glob("profile/rank*.json"))]
    charts, notes = [], []
    for draw in (_loss, _throughput, _memory, _bubble, _time_split):
        made = draw(records, ranks, [p for p in profiles if p], out)
        if isinstance(made, Chart):
            charts.append(made)
        elif made:
            notes.append(made)
    page = out / "report.html"
    config = run_dir / "config.toml"
    page.write_text(
        _page(
            run_dir,
            summary,
            charts,
            notes,
            _events(records),
            config.read_text() if config.is_file() else "",
        )
    )
    return page


def _json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """A metric's values by step; after a resume the recomputed steps replace the first ones."""
    by_step = {int(r["step"]): float(r[key]) for r in records if key in r}
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def _figure() -> Any:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 3.2), dpi=110)
    ax.grid(alpha=0.3)
    return fig, ax


def _save(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _loss(records: list[dict[str, Any]], ranks: Any, profiles: Any, out: Path) -> Chart | str:
    steps, loss = _series(records, "loss")
    if not steps:
        return "no training loss was recorded"
    fig, ax = _figure()
    ax.plot(steps, loss, label="train loss", color="tab:blue")
    eval_steps, eval_loss = _series(records, "eval/loss")
    if eval_steps:
        ax.plot(eval_steps, eval_loss, "o-", label="eval loss", color="tab:orange")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    acc_steps, accuracy = _series(records, "eval/accuracy")
    if acc_steps:
        twin = ax.twinx()
        twin.plot(acc_steps, accuracy, "s--", color="tab:green", label="eval accuracy")
        twin.set_ylabel("accuracy")
        twin.legend(loc="center right")
    ax.legend(loc="upper right")
    path = out / "loss.png"
    _save(fig, path)
    return Chart("Loss and evaluation", path, "training loss per log window; evaluations")


def _throughput(records: list[dict[str, Any]], ranks: Any, profiles: Any, out: Path) -> Chart | str:
    key = "tokens/s" if any("tokens/s" in r for r in records) else "samples/s"
    steps, rate = _series(records, key)
    if not steps:
        return "no throughput was recorded"
    import matplotlib.pyplot as plt

    mfu_steps, mfu = _series(records, "mfu")
    rows = 2 if mfu_steps else 1
    fig, axes = plt.subplots(
        rows, 1, figsize=(7.0, 2.4 * rows), dpi=110, sharex=True, squeeze=False
    )
    top = axes[0][0]
    top.plot(steps, rate, color="tab:blue")
    top.set_ylabel(key)
    top.set_ylim(bottom=0)
    top.grid(alpha=0.3)
    caption = f"{key} per log window"
    if mfu_steps:
        low = axes[1][0]
        low.plot(mfu_steps, mfu, color="tab:red")
        low.set_ylabel("MFU (%)")
        low.set_ylim(bottom=0)
        low.grid(alpha=0.3)
        caption += "; MFU = counted model FLOPs / time / the peak measured at start"
    axes[-1][0].set_xlabel("step")
    path = out / "throughput.png"
    _save(fig, path)
    return Chart("Throughput and utilisation", path, caption)


def _memory(records: Any, ranks: list[dict[str, Any]], profiles: Any, out: Path) -> Chart | str:
    if not ranks:
        return "no per-rank memory (the run has no summary.json yet)"
    keys = [k for k in ("params", "grads", "optimizer", "peak") if k in ranks[0]]
    fig, ax = _figure()
    width = 0.8 / len(keys)
    for i, key in enumerate(keys):
        xs = [r["rank"] + i * width for r in ranks]
        ax.bar(xs, [r[key] / MIB for r in ranks], width=width, label=key)
    ax.set_xticks([r["rank"] + 0.4 - width / 2 for r in ranks], [str(r["rank"]) for r in ranks])
    ax.set_xlabel("rank")
    ax.set_yscale("log")  # the peak (with the runtime) dwarfs a small model's state
    ax.set_ylabel("MiB (log scale)")
    ax.legend()
    path = out / "memory.png"
    _save(fig, path)
    return Chart("Memory per rank", path, "model state held and peak memory (device, or RSS)")


def _bubble(records: Any, ranks: list[dict[str, Any]], profiles: Any, out: Path) -> Chart | str:
    piped = [r for r in ranks if "bubble" in r]
    if not piped:
        return ""
    fig, ax = _figure()
    ax.bar([r["rank"] for r in piped], [100 * r["bubble"] for r in piped], label="measured")
    theory = 100 * float(piped[0]["bubble_theory"])
    ax.axhline(theory, color="tab:red", linestyle="--", label=f"theory {theory:.1f}%")
    ax.set_xlabel("rank")
    ax.set_ylabel("idle share of step (%)")
    ax.legend()
    path = out / "bubble.png"
    _save(fig, path)
    return Chart("Pipeline bubble", path, "measured idle share per rank against (p−1)/(m+p−1)")


def _time_split(records: Any, ranks: Any, profiles: list[dict[str, Any]], out: Path) -> Chart | str:
    profiles = [p for p in profiles if "compute_s" in p]  # a window that ran
    if not profiles:
        return (
            "no profiler window was recorded (tracking.profile_step = 0, a shorter run, or a "
            "resume after its first step)"
        )
    parts = ("compute_s", "communication_s", "data_s")
    fig, ax = _figure()
    bottom = [0.0] * len(profiles)
    labels = [str(i) for i in range(len(profiles))]
    for part in parts:
        values = [1e3 * p[part] for p in profiles]
        ax.bar(labels, values, bottom=bottom, label=part.removesuffix("_s"))
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    saves = [r["checkpoint/save_s"] for r in records if "checkpoint/save_s" in r]
    last = max((int(r["step"]) for r in records), default=1)
    if saves:
        per_step = 1e3 * sum(saves) / last
        ax.bar(labels, [per_step] * len(labels), bottom=bottom, label="checkpoint (amortised)")
    ax.set_xlabel("rank")
    ax.set_ylabel("ms per step")
    ax.legend()
    path = out / "time.png"
    _save(fig, path)
    first = profiles[0].get("first_step", "?")
    return Chart(
        "Where a step's time goes",
        path,
        f"torch.profiler window from step {first}: the training thread's time in compute, "
        "exposed communication and data loading; checkpoint saves spread over all steps",
    )


def _events(records: list[dict[str, Any]]) -> list[tuple[int, str]]:
    """Restarts, skipped steps, stragglers, failed saves and compile time, by step."""
    found = []
    for r in records:
        step = int(r["step"])
        if "fault/restarts" in r:
            found.append((step, f"restart {int(r['fault/restarts'])}: resumed from the checkpoint"))
        if "fault/skipped_steps" in r:
            skipped = int(r["fault/skipped_steps"])
            found.append((step, f"skipped steps so far: {skipped} (NaN or infinite gradient norm)"))
        if "checkpoint/failed_saves" in r:
            found.append((step, f"{int(r['checkpoint/failed_saves'])} failed checkpoint saves"))
        if "compile/seconds" in r:
            found.append((step, f"torch.compile took {r['compile/seconds']:.1f} s"))
        found += [(step, line) for line in _live_events(r)]
        for key, value in r.items():
            if key.startswith("straggler/") and value:
                found.append((step, f"{key.removeprefix('straggler/')} was a straggler"))
    return found


def _live_events(r: dict[str, Any]) -> list[str]:
    """Live recovery's timeline (fault/live_replica.py): replicas lost, the step committed
    again, replacements healed, waits for one."""
    lines = []
    replicas = int(r.get("live/replicas", 0))
    if "live/detected_s" in r:
        lost = int(r.get("live/lost_replicas", 1))
        lines.append(
            f"live: {lost} replica{'s' if lost > 1 else ''} lost, detected in "
            f"{r['live/detected_s']:.3f} s; the {replicas} left do the step again"
        )
    if "live/waited_s" in r:
        lines.append(f"live: waited {r['live/waited_s']:.2f} s for a replacement (min_replicas)")
    if "live/stall_s" in r:
        lines.append(f"live: the step committed {r['live/stall_s']:.3f} s after the loss")
    if "live/heal_bytes" in r:
        healed = int(r.get("live/healed_replicas", 1))
        lines.append(
            f"live: replica {int(r.get('live/heal_source', 0))} healed {healed} "
            f"replacement{'s' if healed > 1 else ''} ({human_bytes(r['live/heal_bytes'])} in "
            f"{r['live/heal_s']:.3f} s); {replicas} replicas"
        )
    return lines


def _page(
    run_dir: Path,
    summary: dict[str, Any] | None,
    charts: list[Chart],
    notes: list[str],
    events: list[tuple[int, str]],
    config: str,
) -> str:
    e = html.escape
    head = "<p>The run has not finished (no summary.json).</p>"
    if summary:
        shown = {k: v for k, v in summary.get("metrics", {}).items() if isinstance(v, float)}
        cells = "".join(f"<tr><td>{e(k)}</td><td>{_number(v)}</td></tr>" for k, v in shown.items())
        state = "preempted (SIGTERM)" if summary.get("preempted") else "finished"
        rate = _number(summary.get("samples_per_second"))
        head = (
            f"<p>{state} at step {summary.get('step')}; {rate} samples/s (median window); "
            f"checkpoint {e(str(summary.get('checkpoint')))}</p>"
            f"<table>{cells}</table>"
        )
    figures = "".join(
        f"<figure><h2>{e(c.title)}</h2><img alt='{e(c.title)}' src='data:image/png;base64,"
        f"{base64.b64encode(c.path.read_bytes()).decode()}'><figcaption>{e(c.caption)}"
        "</figcaption></figure>"
        for c in charts
    )
    missing = "".join(f"<li>{e(n)}</li>" for n in notes)
    rows = "".join(f"<tr><td>{s}</td><td>{e(t)}</td></tr>" for s, t in events)
    table = (
        f"<table>{rows}</table>"
        if rows
        else "<p>No restarts, replicas lost, skipped steps or stragglers.</p>"
    )
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>shardwise report: {e(run_dir.name)}</title>
<style>body{{font-family:sans-serif;max-width:60em;margin:2em auto;color:#222}}
img{{max-width:100%}}table{{border-collapse:collapse}}td{{padding:2px 8px;border:1px solid #ddd}}
pre{{background:#f6f6f6;padding:1em;overflow:auto}}</style></head>
<body><h1>shardwise run {e(str(run_dir))}</h1>{head}{figures}
<h2>Events</h2>{table}
{f"<h2>Not shown</h2><ul>{missing}</ul>" if missing else ""}
<h2>Configuration</h2><pre>{e(config)}</pre></body></html>
"""


def _number(value: Any) -> str:
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:,.4g}"
    return html.escape(str(value))
