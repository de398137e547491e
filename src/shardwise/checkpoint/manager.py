"""Checkpoints written with torch.distributed.checkpoint (DCP): every rank writes its own part in
parallel and rank 0 commits, so the same files serve every later layout (DCP reshards on load).

A checkpoint is written as `step_00000100.partial` and renamed to `step_00000100` only after
every rank's data, DCP's `.metadata` and the manifest are on disk, so a crash mid-save never leaves
a checkpoint that looks complete (see layout.py). This module must not know what is in the state:
the trainer decides that.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from shardwise.checkpoint.layout import (
    MANIFEST,
    file_digest,
    read_manifest,
    retention_victims,
)


class WriteFailed(RuntimeError):
    """An asynchronous save failed in the background; `step` is the checkpoint it was writing."""

    def __init__(self, step: int, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.step = step


class CheckpointManager:
    """Save and load whole-job checkpoints in one directory; all ranks call both methods."""

    def __init__(self, directory: Path, *, keep_last: int, asynchronous: bool = False) -> None:
        self.directory = directory
        self.keep_last = keep_last
        self.is_leader = dist.get_rank() == 0
        self.asynchronous = asynchronous
        # DCP's background writer synchronises the ranks on its own group, so its collectives
        # never interleave with training's.
        self._async_group = dist.new_group(backend="gloo") if asynchronous else None
        self._pending: tuple[Future[Any], int, dict[str, Any], float] | None = None

    def save(self, step: int, state: dict[str, Any], manifest: dict[str, Any]) -> Path:
        """Write `state` as the checkpoint of `step` and return its directory. Synchronous: the
        checkpoint is committed on return. Asynchronous: the state is copied to memory and
        written in the background; it is committed by the next `save` or by `wait`."""
        self.wait()
        final = self.directory / f"step_{step:08d}"
        partial = final.with_name(final.name + ".partial")
        if self.is_leader:
            shutil.rmtree(partial, ignore_errors=True)  # left by a crash during an earlier save
            partial.mkdir(parents=True)
        dist.barrier()
        started = time.perf_counter()
        if self.asynchronous:
            future = dcp_async_save(state, checkpoint_id=partial, process_group=self._async_group)
            assert isinstance(future, Future)
            self._pending = (future, step, manifest, started)
            return final
        dcp_save(state, checkpoint_id=partial)
        self._finish(step, manifest, started)
        return final

    def wait(self) -> Path | None:
        """Finish and commit an asynchronous save still in flight (all ranks call it)."""
        if self._pending is None:
            return None
        future, step, manifest, started = self._pending
        self._pending = None
        try:
            future.result()
        except BaseException as e:  # DCP raises CheckpointException, a BaseException
            self.discard_partial(step)
            raise WriteFailed(step, e) from e
        return self._finish(step, manifest, started)

    def _finish(self, step: int, manifest: dict[str, Any], started: float) -> Path:
        final = self.directory / f"step_{step:08d}"
        partial = final.with_name(final.name + ".partial")
        files = self._digests(partial)
        if self.is_leader:
            files[".metadata"] = file_digest(partial / ".metadata")
            manifest = {
                **manifest,
                "step": step,
                "saved_at": time.time(),
                "save_seconds": time.perf_counter() - started,
                "files": files,
            }
            _write_synced(partial / MANIFEST, json.dumps(manifest, indent=2))
            self._commit(partial, final)
            self._apply_retention()
        dist.barrier()
        return final

    def discard_partial(self, step: int) -> None:
        """Remove what a failed save of `step` left behind (all ranks call it)."""
        if self.is_leader:
            shutil.rmtree(self.directory / f"step_{step:08d}.partial", ignore_errors=True)

    def _digests(self, partial: Path) -> dict[str, Any]:
        """Size and checksum of every file, each rank hashing the files it wrote (DCP names them
        `__<rank>_<n>.distcp`), gathered on rank 0 for the manifest."""
        rank = dist.get_rank()
        mine = {p.name: file_digest(p) for p in sorted(partial.glob(f"__{rank}_*"))}
        gathered: list[Any] = [None] * dist.get_world_size() if self.is_leader else []
        dist.gather_object(mine, gathered if self.is_leader else None, dst=0)
        return {name: d for part in gathered for name, d in part.items()}

    def load(self, path: Path, state: dict[str, Any]) -> dict[str, Any]:
        """Fill `state` in place from the checkpoint at `path`; returns its manifest."""
        dcp_load(state, checkpoint_id=path)
        return read_manifest(path)

    def _commit(self, partial: Path, final: Path) -> None:
        replaced = final.with_name(final.name + ".replaced")
        if final.exists():  # same step saved before, e.g. by a run resumed from an older step
            shutil.rmtree(replaced, ignore_errors=True)
            final.rename(replaced)
        partial.rename(final)
        _fsync_dir(final.parent)
        shutil.rmtree(replaced, ignore_errors=True)

    def _apply_retention(self) -> None:
        for old in retention_victims(self.directory, self.keep_last):
            shutil.rmtree(old, ignore_errors=True)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
