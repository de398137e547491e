"""Fault injection, for tests and fire drills: make a real run fail the way long runs fail.

`SHARDWISE_FAULT` lists faults separated by commas, each `kind:key=value:…`:

    kill:rank=1:step=7         the rank SIGKILLs itself after step 7 (an OOM kill, a lost node);
                               in live recovery `at=` names another point of step 7 (or of
                               the membership change in it): before_forward, reduce (inside
                               the all-reduce: the others are in it), after_reduce (before
                               the optimizer); reform, heal_send: the first such at step 7 or
                               later; heal_receive: the rank's first replacement, as it heals
    nan:step=5                 step 5's gradients become NaN on every rank (or `rank=`)
    stall:rank=1:step=4        the rank stops making progress after step 4 (`seconds=`, default
                               forever) — a hung collective, a dead NIC
    stop:rank=1:step=4         the rank SIGSTOPs itself after step 4: every thread of it
                               frozen until a SIGCONT or SIGKILL (a stuck kernel, a debugger)
    sigterm:step=6             rank 0 sends SIGTERM to the launcher after step 6 (preemption)
    slow:rank=1:step=1:seconds=0.05
                               from step 1 on, the rank spends 50 ms more on every step before
                               its forward pass (a straggler)
    save_error:step=10         saving the checkpoint of step 10 fails as a full disk does
    corrupt:rank=1:step=5      after step 5 the rank's first parameter silently changes (a bit
                               flip in memory): live replicas' state hashes catch it
    lose:rank=0:step=5         in live recovery, the rank's all-reduce of step 5 completes but
                               the rank takes it as failed, as gloo's ring can leave one member
                               when a peer dies inside it: its peers commit the step, it does not

Faults fire on the first attempt only: after the launcher restarts the workers, or Slurm requeues
the job (`SLURM_RESTART_COUNT`), they run clean, so a test can check that the restarted run
finishes like an uninterrupted one.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from shardwise.common.environment import launcher_pid
from shardwise.common.errors import ConfigError

ENV = "SHARDWISE_FAULT"
KINDS = ("kill", "nan", "stall", "stop", "sigterm", "save_error", "slow", "corrupt", "lose")


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int | None = None
    """None: every rank (rank 0 alone for `sigterm`)."""
    seconds: float = float("inf")
    at: str = "after_step"
    """Where in the step a `kill` fires (POINTS)."""


POINTS = ("after_step", "before_forward", "reduce", "after_reduce", "reform", "heal_send",
          "heal_receive")  # fmt: skip


def parse(text: str) -> list[Fault]:
    """Faults from the `SHARDWISE_FAULT` syntax; a malformed entry is a `ConfigError`."""
    faults = []
    for entry in filter(None, (part.strip() for part in text.split(","))):
        kind, *pairs = entry.split(":")
        values: dict[str, str] = {}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep:
                raise ConfigError(f"{ENV}: '{pair}' in '{entry}' is not key=value")
            values[key] = value
        keys = {"step", "rank", "seconds"} | ({"at"} if kind == "kill" else set())
        if kind not in KINDS or "step" not in values or set(values) - keys:
            raise ConfigError(
                f"{ENV}: cannot read '{entry}'; expected kind:step=N[:rank=R][:seconds=S] with "
                f"kind one of {', '.join(KINDS)}"
            )
        faults.append(
            Fault(
                kind=kind,
                step=int(values["step"]),
                rank=int(values["rank"]) if "rank" in values else None,
                seconds=float(values.get("seconds", "inf")),
                at=values.get("at", "after_step"),
            )
        )
        if faults[-1].at not in POINTS:
            raise ConfigError(f"{ENV}: at={faults[-1].at} in '{entry}': one of {', '.join(POINTS)}")
    return faults


class FaultPlan:
    """The faults this rank will inject; empty (and free) unless `SHARDWISE_FAULT` is set."""

    def __init__(self, faults: Iterable[Fault], *, rank: int, attempt: int) -> None:
        self.rank = rank
        # a replacement's heal happens in the rank's second attempt only
        self.faults = [
            f for f in faults if attempt == int(f.at == "heal_receive") and self._mine(f)
        ]

    @classmethod
    def from_env(
        cls, *, rank: int, attempt: int, environ: Mapping[str, str] | None = None
    ) -> FaultPlan:
        """`attempt`: the launcher's restarts so far; a job Slurm requeued adds its own."""
        env = os.environ if environ is None else environ
        requeued = int(env.get("SLURM_RESTART_COUNT", "0") or 0)
        return cls(parse(env.get(ENV, "")), rank=rank, attempt=attempt + requeued)

    def _mine(self, fault: Fault) -> bool:
        if fault.rank is not None:
            return fault.rank == self.rank
        return self.rank == 0 if fault.kind == "sigterm" else True

    def _due(self, kind: str, step: int) -> bool:
        return any(f.kind == kind and f.step == step for f in self.faults)

    def before_step(self, step: int) -> None:
        for fault in self.faults:
            if fault.kind == "slow" and step >= fault.step:
                time.sleep(fault.seconds)
        self.kill_at("before_forward", step)

    def kill_at(self, point: str, step: int) -> None:
        """SIGKILL this process where a `kill` fault names `point` of `step` (see the module
        docstring for the points of a membership change)."""
        for f in self.faults:
            if f.kind != "kill" or f.at != point:
                continue
            if (
                point == "heal_receive"
                or f.step == step
                or (point in ("reform", "heal_send") and step >= f.step)
            ):
                os.kill(os.getpid(), signal.SIGKILL)

    def loses(self, step: int) -> bool:
        """Whether this rank takes its completed all-reduce of `step` as failed (`lose`)."""
        return self._due("lose", step)

    def corrupt_gradients(self, step: int, params: Iterable[torch.nn.Parameter]) -> None:
        if self._due("nan", step):
            for p in params:
                if p.grad is not None:
                    p.grad.fill_(float("nan"))
                    return

    def corrupt_parameters(self, step: int, params: Iterable[torch.nn.Parameter]) -> None:
        if self._due("corrupt", step):
            with torch.no_grad():
                next(iter(params)).add_(1.0)

    def before_save(self, step: int) -> None:
        if self._due("save_error", step):
            raise OSError(errno.ENOSPC, f"No space left on device (injected at step {step})")

    def after_step(self, step: int) -> None:
        for fault in self.faults:
            if fault.step != step:
                continue
            if fault.kind == "kill" and fault.at == "after_step":
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault.kind == "stall":
                time.sleep(fault.seconds if fault.seconds != float("inf") else 10**9)
            elif fault.kind == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif fault.kind == "sigterm":
                os.kill(launcher_pid(), signal.SIGTERM)  # the launcher (elastic agent)
