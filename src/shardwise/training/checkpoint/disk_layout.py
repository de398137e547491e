"""How checkpoints are laid out, readable without torch: `<dir>/step_00000100/` holds DCP's
files, its `.metadata`, and shardwise's manifest `shardwise.json` (step, world size, layout,
config hash, and the size and SHA-256 of every file). `<dir>` is a local directory or any fsspec
URL (`s3://bucket/prefix`, `gs://…`, `memory://…`); checkpoints are named by URL strings.

A checkpoint is complete when both `shardwise.json` and `.metadata` are there: the manifest is
written last, after every rank's data, so it is the commit marker (on a local disk the directory
is also renamed into place; see manager.py). It is good when every file the manifest lists is
there with its size (and, checked fully, its checksum). Names sort by step. The launcher uses
this to pick a checkpoint before any worker starts.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from typing import Any

from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from fsspec.spec import AbstractFileSystem

MANIFEST = "shardwise.json"
_PREFIX = "step_"

Location = str | os.PathLike[str]


def storage(location: Location) -> tuple[AbstractFileSystem, str]:
    """The file system holding `location` and the path on it. Listings are not cached: other
    ranks and processes write to the same place."""
    fs, path = url_to_fs(os.fspath(location))
    fs.invalidate_cache()
    return fs, path


def is_local(location: Location) -> bool:
    return isinstance(storage(location)[0], LocalFileSystem)


def join(location: Location, name: str) -> str:
    return os.fspath(location).rstrip("/") + "/" + name


def name_of(location: Location) -> str:
    return os.fspath(location).rstrip("/").rsplit("/", 1)[-1]


def _step_dirs(directory: Location) -> list[str]:
    """Every `step_NNNNNNNN` in `directory`, complete or not, oldest first."""
    fs, path = storage(directory)
    if not fs.isdir(path):
        return []
    names = (name_of(p) for p in fs.ls(path, detail=False))
    return sorted(join(directory, n) for n in names if _is_step_dir(n))


def complete_checkpoints(directory: Location) -> list[str]:
    """Complete checkpoints in `directory`, oldest first."""
    return [p for p in _step_dirs(directory) if is_complete(p)]


def _is_step_dir(name: str) -> bool:
    digits = name.removeprefix(_PREFIX)
    return name.startswith(_PREFIX) and len(digits) == 8 and digits.isdigit()


def read_manifest(location: Location) -> dict[str, Any]:
    """A checkpoint's manifest; ValueError when it is not JSON or not shaped as shardwise writes
    it (an object with the step, the model and every file's size and checksum)."""
    fs, path = storage(join(location, MANIFEST))
    manifest = json.loads(fs.cat_file(path))
    wrong = _manifest_problem(manifest)
    if wrong is not None:
        raise ValueError(wrong)
    return manifest  # type: ignore[no-any-return]


def _manifest_problem(manifest: Any) -> str | None:
    if not isinstance(manifest, dict):
        return f"it is a JSON {type(manifest).__name__}, not an object"
    step = manifest.get("step")
    if not _count(step):
        return f"its step is {step!r}, not a whole number"
    for key in ("model", "degrees"):
        if not isinstance(manifest.get(key, {}), dict):
            return f"its {key} is {manifest[key]!r}, not an object"
    files = manifest.get("files")
    if not isinstance(files, dict) or ".metadata" not in files:
        return "it lists no files, or not DCP's .metadata"
    for name, entry in files.items():
        if not name or "/" in name or "\\" in name or name in (".", ".."):
            return f"it lists a file named {name!r}, which is not a file of the checkpoint"
        if not isinstance(entry, dict) or not _count(entry.get("bytes")):
            return f"its entry for {name} has no size"
        digest = entry.get("sha256")
        if not (isinstance(digest, str) and len(digest) == 64 and set(digest) <= _HEX):
            return f"its entry for {name} has no SHA-256 checksum"
    return None


_HEX = set("0123456789abcdef")


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def is_complete(location: Location) -> bool:
    fs, path = storage(location)
    return all(fs.isfile(f"{path}/{name}") for name in (MANIFEST, ".metadata"))


def file_digest(location: Location) -> dict[str, Any]:
    """Size and SHA-256 of one file, as the manifest records them."""
    fs, path = storage(location)
    digest, size = hashlib.sha256(), 0
    with fs.open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": digest.hexdigest()}


def problem(location: Location, *, checksums: bool = True) -> str | None:
    """What is wrong with the checkpoint at `location`, or None when it is good: a missing or
    unreadable manifest, a listed file missing, truncated or (with `checksums`) corrupted."""
    if not is_complete(location):
        return "it has no manifest or no DCP metadata (an interrupted save)"
    try:
        files: dict[str, dict[str, Any]] = read_manifest(location)["files"]
    except (OSError, ValueError) as e:
        return f"its manifest cannot be read ({e})"
    fs, path = storage(location)
    sizes = {name_of(p): info["size"] for p, info in fs.find(path, detail=True).items()}
    for name, expected in sorted(files.items()):
        if name not in sizes:
            return f"{name} is missing"
        size, listed = sizes[name], expected["bytes"]
        if size != listed:
            return f"{name} is {size} bytes, the manifest says {listed} (truncated)"
        if checksums and file_digest(join(location, name))["sha256"] != expected["sha256"]:
            return f"{name} does not match its checksum (corrupted)"
    return None


def retention_victims(directory: Location, keep_last: int, *, good: str = "") -> list[str]:
    """Checkpoints `keep_last` retention deletes: those older than the newest `keep_last` that
    verify (every file listed, at its size, with its checksum). One that fails is neither
    counted nor deleted (`--resume auto` skips it, and it is evidence), so retention never
    deletes the newest good checkpoint, however a bad one was damaged. `good`: a checkpoint
    known to verify (just committed, its checksums taken as it was written)."""
    kept, victims = 0, []
    for location in reversed(complete_checkpoints(directory)):
        if kept >= keep_last:
            victims.append(location)
        elif os.fspath(location) == os.fspath(good) or verified(location):
            kept += 1
    return victims


_VERIFIED: dict[tuple[str, bytes, tuple[tuple[str, int], ...]], bool] = {}


def verified(location: Location) -> bool:
    """Whether the checkpoint passes `problem` with checksums. A save runs retention over the
    same checkpoints again and again, so the answer is remembered for the manifest and the file
    sizes it saw: each checkpoint is hashed once per process, not once per save."""
    try:
        fs, path = storage(location)
        listing = fs.find(path, detail=True)
        key = (
            os.fspath(location),
            fs.cat_file(f"{path}/{MANIFEST}"),
            tuple(sorted((name_of(p), int(info["size"])) for p, info in listing.items())),
        )
    except (OSError, ValueError):
        return False
    if key not in _VERIFIED:
        _VERIFIED[key] = problem(location) is None
    return _VERIFIED[key]


def newest_good(directory: Location) -> tuple[str | None, list[str]]:
    """The newest checkpoint that passes `problem`, and a warning for each newer one skipped."""
    warnings: list[str] = []
    for location in reversed(_step_dirs(directory)):
        wrong = problem(location)
        if wrong is None:
            return location, warnings
        warnings.append(f"skipping checkpoint {name_of(location)}: {wrong}")
    return None, warnings


def retire(location: Location) -> None:
    """Make a checkpoint no checkpoint (its manifest, the commit marker, deleted); `remove`
    deletes the rest."""
    fs, path = storage(location)
    if isinstance(fs, LocalFileSystem) and os.path.islink(path):
        return
    if fs.exists(f"{path}/{MANIFEST}"):
        fs.rm_file(f"{path}/{MANIFEST}")


def remove(location: Location) -> None:
    """Delete a checkpoint, its manifest first: a half-deleted checkpoint never looks complete
    (deleting a prefix from an object store is many requests, not one). A local checkpoint that
    is a symlink is unlinked, never deleted through: what it points to is not ours."""
    fs, path = storage(location)
    if isinstance(fs, LocalFileSystem) and os.path.islink(path):
        os.unlink(path)
        return
    if fs.exists(f"{path}/{MANIFEST}"):
        fs.rm_file(f"{path}/{MANIFEST}")
    if fs.exists(path):
        fs.rm(path, recursive=True)


def probe_writable(directory: Location) -> str | None:
    """Why `directory` cannot take a checkpoint (an unknown URL scheme, a missing bucket, no
    permission, bad credentials), found by writing and deleting a small file; None when it can."""
    probe = join(directory, f".shardwise-probe-{uuid.uuid4().hex}")  # every rank may probe
    try:
        fs, path = storage(probe)
        if isinstance(fs, LocalFileSystem):  # object stores have no directories to make
            fs.makedirs(storage(directory)[1], exist_ok=True)
        fs.pipe_file(path, b"ok")
        fs.rm_file(path)
    except ImportError as e:  # fsspec knows the scheme, its package is not installed
        return f"{e}".split("\n")[0]
    except Exception as e:  # each store raises its own errors (ValueError, OSError, botocore…)
        return f"cannot write there ({type(e).__name__}: {e})".split("\n")[0]
    return None
