"""Saving and restoring a run: what a checkpoint holds (`trainer/state.py` captures it), its
manifest, and the data position and schedule a non-finite step rewinds to."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from shardwise.common.console import warn
from shardwise.common.job_files import redacted_dump
from shardwise.training.checkpoint import safe
from shardwise.training.checkpoint.disk_layout import name_of, read_manifest
from shardwise.training.checkpoint.manager import (
    WriteFailed,
)
from shardwise.training.parallel.mesh import dp_position
from shardwise.training.trainer import state as train_state
from shardwise.training.trainer.step import Run


class SaveFailed(RuntimeError):
    """Writing a checkpoint failed on every rank (what was written of it is removed)."""


def save(run: Run, step: int, *, final: bool = False) -> str:
    """Checkpoint the run at `step`; a failed write raises `SaveFailed` after cleaning up. The
    `final` checkpoint is committed before this returns, even an asynchronous one, so that
    nothing after it (the last evaluation) can lose the trained model."""
    state = capture(run, step)
    try:
        run.faults.before_save(step)
        buffers = train_state.own_buffers(state, run.parts)
        if run.layout.pipeline is not None:  # DCP's planner runs on rank 0: it needs all stages'
            buffers = _on_every_rank(buffers)
        path = run.checkpoints.save(step, state, _manifest(run), first_holder=buffers)
        if final:
            run.checkpoints.wait()
        return path
    except WriteFailed as e:  # the previous, asynchronous save
        raise SaveFailed(f"saving the checkpoint of step {e.step} failed: {e}") from e
    except (OSError, RuntimeError, CheckpointException) as e:
        run.checkpoints.discard_partial(step)
        raise SaveFailed(f"saving the checkpoint of step {step} failed: {e}") from e


def _on_every_rank(keys: frozenset[str]) -> frozenset[str]:
    """The union of every rank's `keys`: under a pipeline rank 0 holds its own stages' buffers
    only, and left to DCP the later stages' would be written by whichever replica it chose."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sorted(keys))
    return frozenset(key for found in gathered for key in found)


def capture(run: Run, step: int) -> dict[str, Any]:
    """The run's state as a checkpoint holds it (trainer/state.py), taken after `step`; what a
    save writes and a restore fills."""
    return train_state.capture(
        parts=run.parts,
        optimizers=run.optimizers,
        scheduler=run.schedulers[0],
        scaler=run.scaler,
        loader=run.loader,
        step=step,
        rank=run.rank,
        sync=run.sync,
    )


def restore(run: Run, path: str) -> int:
    """Load the checkpoint at `path` into the run; returns the step to continue after.

    Model, optimizer, schedule and data position load under any layout (DCP reshards). Random
    states come back only when the layout is the same (and the checkpoint holds them as
    tensors); otherwise each rank reseeds from (seed, step, data-parallel rank).
    """
    manifest = read_manifest(path)
    state = capture(run, 0)
    same_layout, saved_rng = manifest.get("degrees") == run.derived.degrees, False
    if same_layout:
        state, saved_rng = train_state.with_saved_rng(state, safe.keys(path))
        state, _ = train_state.with_saved_sync(state, safe.keys(path))
        if not saved_rng and run.rank == 0:
            warn(
                f"{name_of(path)} holds no random-number states shardwise can load (an older "
                "version pickled them, and a pickle could run code): each rank reseeds from "
                "(seed, step, rank), so the resumed run is exact but not bitwise",
                stacklevel=2,
            )
    else:
        state = train_state.without_rng(state)
    run.checkpoints.load(path, state)
    step = train_state.apply(
        state,
        parts=run.parts,
        optimizers=run.optimizers,
        schedulers=run.schedulers,
        scaler=run.scaler,
        loader=run.loader,
        sync=run.sync,
        rank=run.rank,
    )
    if not saved_rng:
        train_state.reseed(run.config.job.seed, step, dp_position(run.mesh)[0])
    return step


def _manifest(run: Run) -> dict[str, Any]:
    config_json = to_json(redacted_dump(run.config))  # no hash of a password either
    return {
        "world_size": run.derived.world_size,
        "degrees": run.derived.degrees,
        "global_batch": run.derived.global_batch,
        "precision": run.config.train.precision,
        "model": redacted_dump(run.config.model),
        # the job, credentials hidden: what `export --mlflow` rebuilds the model and its input
        # example from (training/tracking/registered_model.py)
        "job": redacted_dump(run.config, exclude_none=True),
        # a streamed table's version (data/stream/source.py): a resume on other data is refused
        **({"data": data} if (data := run.loader.state_dict().get("version")) else {}),
        "config_sha256": hashlib.sha256(config_json.encode()).hexdigest(),
    }


def run_position(run: Run) -> tuple[dict[str, int], list[dict[str, Any]]]:
    """Where the run is between steps, apart from the model and optimizers: the data position
    and the schedule (host-side numbers; nothing waits for the device)."""
    return run.loader.state_dict(), [s.state_dict() for s in run.schedulers]


def rewind(run: Run, position: tuple[dict[str, int], list[dict[str, Any]]]) -> None:
    """Put the data position and the schedule (with the learning rate it set) back to `position`."""
    loader, schedules = position
    run.loader.load_state_dict(loader)
    for scheduler, state in zip(run.schedulers, schedules, strict=True):
        scheduler.load_state_dict(state)
        for group, lr in zip(
            scheduler.optimizer.param_groups, scheduler.get_last_lr(), strict=True
        ):
            group["lr"] = lr


def wait_for_saves(run: Run) -> None:
    try:
        run.checkpoints.wait()  # an asynchronous save still in flight is committed here
    except WriteFailed as e:
        raise SaveFailed(f"saving the checkpoint of step {e.step} failed: {e}") from e


def to_json(value: Any) -> str:
    return json.dumps(value, indent=2, default=str)
