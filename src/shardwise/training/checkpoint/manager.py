"""Checkpoints written with torch.distributed.checkpoint (DCP): every rank writes its own part in
parallel and rank 0 commits, so the same files serve every later layout (DCP reshards on load).

On a local disk a checkpoint is written as `step_00000100.partial` and renamed to
`step_00000100` only after every rank's data, DCP's `.metadata` and the manifest are on disk. An
object store has no atomic rename (a "rename" copies every object), so there the checkpoint is
written in place and the manifest, written last, commits it. Either way a crash mid-save never
leaves a checkpoint that looks complete (see disk_layout.py). This module must not know what is
in the state: the trainer decides that.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from shardwise.training.checkpoint import safe
from shardwise.training.checkpoint.disk_layout import (
    MANIFEST,
    file_digest,
    is_local,
    join,
    name_of,
    read_manifest,
    remove,
    retention_victims,
    retire,
    storage,
)
from shardwise.training.checkpoint.planner import FirstHolderPlanner
from shardwise.training.checkpoint.writer import digests, hashing_writer, parallel_writer


class WriteFailed(RuntimeError):
    """An asynchronous save failed in the background; `step` is the checkpoint it was writing."""

    def __init__(self, step: int, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.step = step


HOST_SHARE = 0.8
"""The share of a host's free memory the copies of its ranks' states may take (async saves)."""


def asynchronous_by_default(
    asked: bool | str, *, cuda: bool, hosts: list[tuple[str, int, int]]
) -> tuple[bool, str | None]:
    """What `checkpoint.async = asked` means: `auto` is asynchronous on GPUs where every host
    has the memory for a copy of each of its ranks' states (`hosts`: each rank's host name,
    state bytes and its host's free memory), synchronous on CPUs; and the line to say why a GPU
    run saves synchronously."""
    if asked != "auto":
        return bool(asked), None
    if not cuda:
        return False, None
    needs: dict[str, int] = {}
    free: dict[str, int] = {}
    for host, need, available in hosts:
        needs[host] = needs.get(host, 0) + need
        free[host] = min(free.get(host, available), available)
    short = [h for h in needs if needs[h] > HOST_SHARE * free[h]]
    if not short:
        return True, None
    host = short[0]
    return False, (
        f"checkpoint.async = 'auto': saving synchronously: copies of the states of {host}'s "
        f"ranks take {needs[host] / 2**30:.1f} GiB of host memory, more than "
        f"{HOST_SHARE:.0%} of the {free[host] / 2**30:.1f} GiB free there (set "
        "checkpoint.async = true to copy anyway)"
    )


class CheckpointManager:
    """Save and load whole-job checkpoints in one directory or fsspec URL; all ranks call both
    methods."""

    def __init__(self, directory: str, *, keep_last: int, asynchronous: bool = False) -> None:
        self.local = is_local(directory)
        self.directory = storage(directory)[1] if self.local else directory  # file:// → path
        self.keep_last = keep_last
        self.is_leader = dist.get_rank() == 0
        self.asynchronous = asynchronous
        # DCP's background writer synchronises the ranks on its own group, so its collectives
        # never interleave with training's.
        self._async_group = dist.new_group(backend="gloo") if asynchronous else None
        self._pending: tuple[Future[Any], int] | None = None
        self.phases: dict[str, float] = {}
        """The last save's seconds by phase on this rank: `stage` (async: the copy to memory,
        what training waits for), `write` (DCP: serialise, write, fsync), `digest` (hash the
        files), `commit` (rank 0: the manifest and the rename)."""
        # The copy an asynchronous save writes from: kept from one save to the next (no
        # allocation, no page faults after the first), pinned for the copy from a GPU.
        cuda = torch.cuda.is_available()
        self._staging = StagingOptions(
            use_pinned_memory=cuda,
            use_shared_memory=False,
            use_async_staging=False,
            use_non_blocking_copy=cuda,
        )
        self._stager = DefaultStager(self._staging) if asynchronous else None
        # Rank 0 deletes what retention retires in the background (big files take a while).
        self._remover = ThreadPoolExecutor(1, thread_name_prefix="shardwise-retention")
        self._retention: list[Future[Any]] = []
        # Rank 0 commits asynchronous saves from a thread of its own, off the training path.
        self._committer = (
            ThreadPoolExecutor(1, thread_name_prefix="shardwise-commit")
            if asynchronous and self.is_leader
            else None
        )

    def save(
        self,
        step: int,
        state: dict[str, Any],
        manifest: dict[str, Any],
        *,
        first_holder: Collection[str] = (),
    ) -> str:
        """Write `state` as the checkpoint of `step` and return where it is; the values named
        in `first_holder` (flattened keys), which the ranks holding them may disagree on, are
        written by the lowest of those ranks (checkpoint/planner.py). Synchronous: the
        checkpoint is committed on return. Asynchronous: the state is copied to memory and
        written in the background, and rank 0 commits it as soon as every rank's part is
        written; the next `save` or `wait` reports how that went."""
        self.wait()
        final, target = self._final(step), self._target(step)
        if self.is_leader:
            remove(target)  # left by a crash during an earlier save (or, in place, replaced)
            if self.local:
                Path(target).mkdir(parents=True)
        dist.barrier()
        started = time.perf_counter()
        manifest = {**manifest, "step": step}
        if self.asynchronous:
            future = dcp_async_save(
                state,
                storage_writer=parallel_writer(target),
                process_group=self._async_group,
                async_stager=self._open_stager(),
                planner=FirstHolderPlanner(first_holder),
            )
            assert isinstance(future, Future)
            self.phases = {"stage": time.perf_counter() - started}
            if self._committer is not None:
                future = self._committer.submit(
                    self._commit_when_written, future, manifest, started
                )
            self._pending = (future, step)
            return final
        writer = hashing_writer(target)
        dcp_save(state, storage_writer=writer, planner=FirstHolderPlanner(first_holder))
        written = time.perf_counter()
        files = self._gathered(digests(writer))
        digested = time.perf_counter()
        if self.is_leader:
            self._commit(manifest, files, started)
        self.phases = {
            "write": written - started,
            "digest": digested - written,
            "commit": time.perf_counter() - digested,
        }
        dist.barrier()
        return final

    def _open_stager(self) -> DefaultStager:
        """The stager kept from the last save, or a new one where torch closed it: torch 2.11's
        DefaultStager closes its copier (dropping the pinned copies) at the end of every stage,
        and a closed one fails on the next save (`KeyError: <class 'type'>`, seen on an H100);
        2.13's keeps it for the next save."""
        copier = getattr(self._stager, "_state_dict_stager", None)
        if self._stager is None or not getattr(copier, "_deepcopy_dispatch", True):
            self._stager = DefaultStager(self._staging)
        return self._stager

    def _final(self, step: int) -> str:
        return join(self.directory, f"step_{step:08d}")

    def _target(self, step: int) -> str:
        """Where the checkpoint of `step` is written before it is committed."""
        return self._final(step) + ".partial" if self.local else self._final(step)

    def wait(self) -> str | None:
        """Wait for an asynchronous save still in flight to be written and committed (all ranks
        call it); raises `WriteFailed` on every rank if it failed on any."""
        for removal in self._retention:
            removal.result()
        self._retention.clear()
        if self._pending is None:
            return None
        future, step = self._pending
        self._pending = None
        error: BaseException | None = None
        try:
            future.result()
        except BaseException as e:  # DCP raises CheckpointException, a BaseException
            error = e
        errors: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(
            errors, None if error is None else f"{type(error).__name__}: {error}"
        )
        failed = [e for e in errors if e is not None]
        if failed:
            self.discard_partial(step)
            raise WriteFailed(step, error or RuntimeError(failed[0]))
        return self._final(step)

    def _commit_when_written(
        self, written: Future[Any], manifest: dict[str, Any], started: float
    ) -> None:
        """Rank 0, in the background: once DCP has written every rank's part (it writes
        `.metadata` only after gathering every rank's result), hash the files and commit."""
        written.result()
        target = self._target(manifest["step"])
        fs, path = storage(target)
        names = sorted(name_of(p) for p in fs.ls(path, detail=False))
        files = {name: file_digest(join(target, name)) for name in names}
        self._commit(manifest, files, started)

    def _commit(self, manifest: dict[str, Any], files: dict[str, Any], started: float) -> None:
        """Rank 0: write the manifest (last) and make the checkpoint final; apply retention."""
        final, target = self._final(manifest["step"]), self._target(manifest["step"])
        manifest = {
            **manifest,
            "saved_at": time.time(),
            "save_seconds": time.perf_counter() - started,
            "files": files,
        }
        text = json.dumps(manifest, indent=2)
        if self.local:
            _write_synced(Path(target, MANIFEST), text)
            _rename_into_place(Path(target), Path(final))
        else:
            fs, path = storage(join(target, MANIFEST))
            fs.pipe_file(path, text.encode())  # the commit: the manifest comes last
        # this checkpoint was hashed as it was written: retention need not read it back
        victims = retention_victims(self.directory, self.keep_last, good=final)
        for old in victims:
            retire(old)  # its manifest goes now: it is no checkpoint any more
        if victims:  # its data in the background: deleting big files takes a while
            self._retention.append(self._remover.submit(_remove_all, victims))

    def discard_partial(self, step: int) -> None:
        """Remove what a failed save of `step` left behind (all ranks call it)."""
        if self.is_leader:
            remove(self._target(step))

    def _gathered(self, mine: dict[str, Any]) -> dict[str, Any]:
        """Every rank's files (DCP names them `__<rank>_<n>.distcp`; rank 0 also wrote
        `.metadata`), with the sizes and checksums each hashed as it wrote them, on rank 0."""
        gathered: list[Any] = [None] * dist.get_world_size() if self.is_leader else []
        dist.gather_object(mine, gathered if self.is_leader else None, dst=0)
        return {name: d for part in gathered for name, d in part.items()}

    def load(self, location: str, state: dict[str, Any]) -> dict[str, Any]:
        """Fill `state` in place from the checkpoint at `location`, read as data (safe.py);
        returns its manifest."""
        safe.load(state, location)
        return read_manifest(location)


def _remove_all(locations: list[str]) -> None:
    for location in locations:
        remove(location)


def _rename_into_place(partial: Path, final: Path) -> None:
    """Rename a local checkpoint into place (atomic), replacing one of the same step."""
    replaced = final.with_name(final.name + ".replaced")
    if final.exists():  # same step saved before, e.g. by a run resumed from an older step
        remove(replaced)
        final.rename(replaced)
    partial.rename(final)
    _fsync_dir(final.parent)
    remove(replaced)


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
