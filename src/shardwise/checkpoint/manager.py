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
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from shardwise.checkpoint.layout import MANIFEST, complete_checkpoints, read_manifest


class CheckpointManager:
    """Save and load whole-job checkpoints in one directory; all ranks call both methods."""

    def __init__(self, directory: Path, *, keep_last: int) -> None:
        self.directory = directory
        self.keep_last = keep_last
        self.is_leader = dist.get_rank() == 0

    def save(self, step: int, state: dict[str, Any], manifest: dict[str, Any]) -> Path:
        """Write `state` as the checkpoint of `step`; returns the committed directory."""
        final = self.directory / f"step_{step:08d}"
        partial = final.with_name(final.name + ".partial")
        if self.is_leader:
            shutil.rmtree(partial, ignore_errors=True)  # left by a crash during an earlier save
            partial.mkdir(parents=True)
        dist.barrier()
        started = time.perf_counter()
        dcp_save(state, checkpoint_id=partial)
        if self.is_leader:
            manifest = {
                **manifest,
                "step": step,
                "saved_at": time.time(),
                "save_seconds": time.perf_counter() - started,
            }
            _write_synced(partial / MANIFEST, json.dumps(manifest, indent=2))
            self._commit(partial, final)
            self._apply_retention()
        dist.barrier()
        return final

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
        for old in complete_checkpoints(self.directory)[: -self.keep_last]:
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
