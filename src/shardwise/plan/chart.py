"""`shardwise plan --chart out.png`: step time (stacked by term) and memory per device for the
top layouts, with the device's memory as a line."""

from __future__ import annotations

import tempfile
from pathlib import Path

from shardwise.common.errors import ConfigError
from shardwise.plan.search import HEADROOM, Plan

FORMATS = (".png", ".svg", ".pdf", ".jpg", ".jpeg")
MOST_SHOWN = 50
"""The most layouts a chart shows (a bar each, one under another), whatever `--top` lists."""


def chart_path(text: str) -> Path:
    """Where `--chart` writes, checked before the plan is computed and printed: an image name in
    a place that can be written (missing folders are made); ConfigError saying what is wrong."""
    path = Path(text)
    if path.suffix.lower() not in FORMATS:
        raise ConfigError(
            f"--chart {text}: name the image file, ending in {', '.join(FORMATS)} (e.g. plan.png)"
        )
    if path.is_dir():
        example = path / "plan.png"
        raise ConfigError(f"--chart {text}: a directory; name a file in it, e.g. {example}")
    existing = path.parent
    try:
        while not existing.exists():  # write_chart makes the folders missing below it
            existing = existing.parent
        if not existing.is_dir():
            raise ConfigError(f"--chart {text}: {existing} is a file, not a folder")
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise ConfigError(f"--chart {text}: cannot write in {existing} ({e.strerror})") from None
    return path


def write_chart(plan: Plan, path: Path, *, top: int = 10) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    top = min(top, MOST_SHOWN)
    shown = plan.ranked[:top] + plan.dropped[: max(0, top - len(plan.ranked[:top]))][:3]
    names = [c.layout.name() + ("" if c.fits else " ✗") for c in shown]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 0.45 * len(shown) + 3), sharey=True)
    y = range(len(shown))
    start = [0.0] * len(shown)
    for term in shown[0].time.terms():
        values = [c.time.terms()[term] for c in shown]
        left.barh(y, values, left=start, label=term)
        start = [a + b for a, b in zip(start, values, strict=True)]
    left.set_yticks(list(y), names, fontsize=8)
    left.invert_yaxis()
    left.set_xlabel("seconds per step")
    left.legend(fontsize=7, loc="upper left", bbox_to_anchor=(0, -0.12), ncol=3)
    parts = ("params", "grads", "optimizer", "runtime", "activations", "buffers")  # fwd/bwd peak
    start = [0.0] * len(shown)
    for part in parts:
        values = [c.memory.as_dict()[part] / 2**30 for c in shown]
        right.barh(y, values, left=start, label=part)
        start = [a + b for a, b in zip(start, values, strict=True)]
    right.axvline(plan.hardware.memory * HEADROOM / 2**30, color="black", linestyle="--")
    right.set_xlabel("GiB per device (dashed: usable memory)")
    right.legend(fontsize=7, loc="upper left", bbox_to_anchor=(0, -0.12), ncol=5)
    fig.suptitle(f"{plan.devices} × {plan.hardware.name}, global batch {plan.global_batch}")
    fig.tight_layout()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110, format=path.suffix.lower().removeprefix("."))
    except OSError as e:
        raise ConfigError(f"--chart {path}: cannot write it ({e.strerror or e})") from None
    finally:
        plt.close(fig)
