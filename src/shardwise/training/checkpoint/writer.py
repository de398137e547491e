"""DCP's storage writers: several files per rank written at once (`threads()`, each by a thread
of its own), and each hashed as it is written, so the manifest's SHA-256 of every file costs no
second pass over the data (hashing a checkpoint read back took as long as writing it).

A hashing writer's `digests` maps each file it wrote (by name) to its size and SHA-256, as
layout.file_digest computes them from the file. The stream DCP writes to is wrapped; DCP only
writes, asks where it is (`tell`), flushes and syncs (`fileno`), so the bytes hashed are the
file's. Its flush after every tensor is left to the sync before the file is closed.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as FsspecFileSystem
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter
from torch.distributed.checkpoint.storage import StorageWriter

from shardwise.training.checkpoint.disk_layout import Location, is_local, name_of, storage


class _HashingStream:
    """A file being written, hashed on the way (in the thread that writes it: DCP's writer
    threads hash their files in parallel, hashlib letting go of the GIL)."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.size = 0
        self._sha256 = hashlib.sha256()

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = self.raw.write(view)
        written = view.nbytes if written is None else int(written)
        self._sha256.update(view[:written])
        self.size += written
        return written

    def hexdigest(self) -> str:
        return self._sha256.hexdigest()

    def flush(self) -> None:
        """Nothing: DCP flushes after every tensor it writes, a system call each; the buffer
        is flushed before the file is synced (`fileno`) and when it is closed."""

    def fileno(self) -> int:
        """The file's descriptor, for DCP's fsync: what is buffered goes to it first."""
        self.raw.flush()
        return int(self.raw.fileno())

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)


class _Hashing:
    """What DCP's file systems gain: `create_stream` hashes what is written (`digests`)."""

    digests: dict[str, dict[str, Any]]
    _lock: threading.Lock

    def _setup(self) -> None:
        self.digests, self._lock = {}, threading.Lock()

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[Any, None, None]:
        with super().create_stream(path, mode) as raw:  # type: ignore[misc]
            if "w" not in mode:
                yield raw
                return
            stream = _HashingStream(raw)
            yield stream
        name = name_of(os.fspath(path)).removesuffix(".tmp")  # DCP renames .metadata.tmp
        digest = {"bytes": stream.size, "sha256": stream.hexdigest()}
        with self._lock:
            self.digests[name] = digest


class _HashingFileSystem(_Hashing, FileSystem):
    def __init__(self) -> None:
        super().__init__()
        self._setup()


class _HashingFsspecFileSystem(_Hashing, FsspecFileSystem):
    def __init__(self) -> None:
        super().__init__()
        self._setup()


class _HashingFsspecWriter(FsspecWriter):
    def __init__(self, path: str) -> None:
        super().__init__(path, thread_count=threads())
        hashing = _HashingFsspecFileSystem()
        hashing.fs = self.fs.fs  # type: ignore[attr-defined]  # what the writer resolved
        self.fs = hashing  # type: ignore[assignment]


def threads() -> int:
    """Files each rank writes at once: DCP splits a rank's state over this many, each written,
    hashed and synced by a thread of its own (up to 4; the cores this process may use)."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


def parallel_writer(location: Location) -> StorageWriter:
    """DCP's writer for a local directory or an fsspec URL, writing `threads()` files at once."""
    if is_local(location):
        return FileSystemWriter(Path(storage(location)[1]), thread_count=threads())
    return FsspecWriter(os.fspath(location), thread_count=threads())


def hashing_writer(location: Location) -> StorageWriter:
    """`parallel_writer`, hashing what it writes."""
    if is_local(location):
        local = FileSystemWriter(Path(storage(location)[1]), thread_count=threads())
        local.fs = _HashingFileSystem()
        return local
    return _HashingFsspecWriter(os.fspath(location))


def digests(writer: StorageWriter) -> dict[str, dict[str, Any]]:
    """What `writer` wrote: each file's size and SHA-256, by name."""
    found: dict[str, dict[str, Any]] = getattr(writer, "fs").digests  # noqa: B009
    return dict(found)
