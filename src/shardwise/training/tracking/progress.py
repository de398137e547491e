"""What rank 0 shows while training: a rich progress bar on a terminal, a plain line per logging
step otherwise (CI logs, files, pipes)."""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table


class ProgressDisplay:
    def __init__(self, *, total_steps: int, start_step: int, console: Console) -> None:
        self.total = total_steps
        self.console = console
        self.started = time.monotonic()
        self.start_step = start_step
        self._bar: Progress | None = None
        if sys.stdout.isatty():
            self._bar = Progress(
                TextColumn("step {task.completed}/{task.total}"),
                BarColumn(),
                TextColumn("{task.fields[stats]}"),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                console=console,
            )
            self._task = self._bar.add_task(
                "train", total=total_steps, completed=start_step, stats=""
            )
            self._bar.start()

    def update(self, step: int, stats: dict[str, float]) -> None:
        text = "  ".join(_format(k, v) for k, v in stats.items())
        if self._bar is not None:
            self._bar.update(self._task, completed=step, stats=text)
            return
        done = step - self.start_step
        elapsed = time.monotonic() - self.started
        eta = elapsed / done * (self.total - step) if done else 0.0
        # a plain line, written as it is: rich's rendering costs the training loop ~0.1 ms a line
        print(
            f"step {step}/{self.total}  {text}  eta {eta:.0f}s", file=self.console.file, flush=True
        )

    def report(self, step: int, stats: dict[str, float]) -> None:
        """A line that stays on screen (evaluation results), above the bar if there is one."""
        self.print(
            f"step {step}/{self.total}  " + "  ".join(_format(k, v) for k, v in stats.items())
        )

    def print(self, text: str) -> None:
        self.console.print(text, highlight=False, soft_wrap=True)

    def print_table(self, table: Table) -> None:
        self.console.print(table)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def _format(key: str, value: float) -> str:
    if key.endswith("/s"):
        return f"{key} {value:,.0f}"
    if key == "lr":
        return f"lr {value:.2e}"
    if key == "mfu":
        return f"MFU {value:.1f}%"
    if key == "mfu_datasheet":
        return f"(data sheet {value:.1f}%)"
    if key == "tflops":
        return f"TFLOP/s {value:.3g}"
    return f"{key} {value:.4f}"
