"""Reading a checkpoint as data, never as code.

torch's DCP reads a checkpoint's `.metadata` with `pickle.load` and every value that is not a
tensor with `torch.load(weights_only=False)`: a checkpoint directory someone doctored (the
manifest updated to match, so checksums pass) would run code on `--resume` or `export`. Here the
metadata is unpickled by an unpickler that knows only the classes DCP writes there, and values
by torch's weights-only loader (numbers, strings, lists, dicts, tensors). Anything else is a
`ConfigError` naming what was found. Tensors DCP already loads weights-only.

What shardwise writes is data too: training progress as numbers, random-number states as
tensors (trainer/state.py). This module must not decide what a checkpoint holds.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.storage import StorageReader

from shardwise.common.errors import ConfigError
from shardwise.training.checkpoint.disk_layout import Location, is_local, name_of, storage

_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "StorageMeta",
        "MetadataIndex",
        "ChunkStorageMetadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint._extension": {"StreamTransformExtension"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's metadata classes, torch sizes and dtypes, and nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = name in _METADATA_CLASSES.get(module, ())
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            allowed = True
        if not allowed:
            raise _Refused(f"{module}.{name}")
        return super().find_class(module, name)


class _Refused(Exception):
    """A checkpoint file names something a checkpoint never holds."""


def read_metadata(data: bytes, where: str) -> Metadata:
    """DCP's metadata from the bytes of a `.metadata` file; a `ConfigError` for anything else."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except _Refused as e:
        raise ConfigError(
            f"{where}: its .metadata holds {e}, so it is not a checkpoint's metadata: refusing "
            "to load it, as unpickling it could run code (see docs/fault-tolerance.md, "
            "'Checkpoints are data')"
        ) from None
    except Exception as e:  # truncated, garbage: pickle raises many kinds
        raise ConfigError(
            f"{where}: its .metadata cannot be read ({type(e).__name__}: {e})"
        ) from None
    if not isinstance(metadata, Metadata):
        raise ConfigError(
            f"{where}: its .metadata holds a {type(metadata).__name__}, not DCP's metadata"
        )
    return metadata


def load(state: dict[str, Any], location: Location) -> None:
    """Fill `state` in place from the checkpoint at `location`, read as data; a refusal is the
    `ConfigError` that says why (DCP wraps what a rank raised in a CheckpointException)."""
    check_metadata(location)  # DCP would fold a refusal into an AssertionError of its own
    try:
        dcp_load(state, storage_reader=reader(location), planner=SafeLoadPlanner())
    except CheckpointException as e:
        refused = [exc for exc, _ in e.failures.values() if isinstance(exc, ConfigError)]
        if refused:
            raise refused[0] from None
        raise


def check_metadata(location: Location) -> None:
    """Refuse, before any process starts, a checkpoint whose metadata is not plain data."""
    keys(location)


def keys(location: Location) -> set[str]:
    """The names of everything the checkpoint at `location` holds (`model.…`, `rng.rank0.…`)."""
    fs, path = storage(location)
    metadata = read_metadata(fs.cat_file(f"{path}/.metadata"), name_of(location))
    return set(metadata.state_dict_metadata)


class _SafeMetadata:
    """`read_metadata` for DCP's readers, through the restricted unpickler."""

    path: Any
    fs: Any
    load_id: Any
    _get_metadata_path: Callable[..., Any]

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            metadata = read_metadata(f.read(), name_of(os.fspath(self.path)))
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeFileSystemReader(_SafeMetadata, FileSystemReader):
    """DCP's reader for a local directory, reading metadata as data."""


class SafeFsspecReader(_SafeMetadata, FsspecReader):
    """DCP's reader for an fsspec URL (s3://…), reading metadata as data."""


def reader(location: Location) -> StorageReader:
    """The safe DCP reader for a checkpoint directory or URL."""
    if is_local(location):
        return SafeFileSystemReader(storage(location)[1])
    return SafeFsspecReader(os.fspath(location))


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, loading values that are not tensors with torch's weights-only
    loader (numbers, strings, lists, dicts), not its pickle-everything default."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise ConfigError(
                f"the checkpoint's value {read_item.dest_index.fqn} is not plain data "
                f"({str(e).strip().splitlines()[0]}): refusing to load it, as it could run code"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
