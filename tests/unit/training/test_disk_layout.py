"""Checkpoint integrity without torch: manifests with sizes and checksums, damaged checkpoints
named and skipped, retention that never deletes the last good checkpoint — on a local disk and
on an fsspec store with no rename (the in-memory one here; S3 in tests/integration)."""

from __future__ import annotations

import json
import uuid

import fsspec
import pytest

from shardwise.training.checkpoint.disk_layout import (
    MANIFEST,
    file_digest,
    join,
    name_of,
    newest_good,
    probe_writable,
    problem,
    remove,
    retention_victims,
)


@pytest.fixture(params=["local", "memory"])
def root(request, tmp_path):
    if request.param == "local":
        yield str(tmp_path)
        return
    url = f"memory://checkpoints-{uuid.uuid4().hex}"
    yield url
    fsspec.filesystem("memory").rm(url.removeprefix("memory://"), recursive=True)


def write(location, data):
    fs, path = fsspec.core.url_to_fs(location)
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    fs.pipe_file(path, data)


def fake_checkpoint(root, step, payload=b"x" * 100):
    path = join(root, f"step_{step:08d}")
    write(join(path, "__0_0.distcp"), payload)
    write(join(path, ".metadata"), b"meta")
    files = {name: file_digest(join(path, name)) for name in ("__0_0.distcp", ".metadata")}
    write(join(path, MANIFEST), json.dumps({"step": step, "files": files}).encode())
    return path


def test_good_truncated_corrupted_and_interrupted(root):
    good = fake_checkpoint(root, 4)
    assert problem(good) is None
    truncated = fake_checkpoint(root, 8)
    write(join(truncated, "__0_0.distcp"), b"x" * 10)
    assert problem(truncated) == "__0_0.distcp is 10 bytes, the manifest says 100 (truncated)"
    corrupted = fake_checkpoint(root, 12)
    write(join(corrupted, "__0_0.distcp"), b"y" * 100)
    assert problem(corrupted) == "__0_0.distcp does not match its checksum (corrupted)"
    assert problem(corrupted, checksums=False) is None
    missing = fake_checkpoint(root, 16)
    fs, path = fsspec.core.url_to_fs(join(missing, "__0_0.distcp"))
    fs.rm_file(path)
    assert problem(missing) == "__0_0.distcp is missing"
    interrupted = fake_checkpoint(root, 20)
    fs.rm_file(fsspec.core.url_to_fs(join(interrupted, MANIFEST))[1])
    assert "no manifest" in problem(interrupted)

    path, skipped = newest_good(root)
    assert path == good
    assert [s.split(":")[0] for s in skipped] == [
        f"skipping checkpoint step_{step:08d}" for step in (20, 16, 12, 8)
    ]


def test_retention_keeps_the_last_good_checkpoint(root):
    for step in (4, 8, 12):
        fake_checkpoint(root, step)
    assert [name_of(p) for p in retention_victims(root, 2)] == ["step_00000004"]
    # the newest is damaged: it does not count, so step 8 and 4 are both kept with keep_last=1…
    write(join(root, "step_00000012/__0_0.distcp"), b"")
    assert [name_of(p) for p in retention_victims(root, 1)] == ["step_00000004"]
    # …and with keep_last=2 nothing good is deleted
    assert retention_victims(root, 2) == []


def test_remove_takes_the_manifest_first_and_leaves_the_others(root):
    old, new = fake_checkpoint(root, 4), fake_checkpoint(root, 8)
    remove(old)
    assert newest_good(root) == (new, [])
    fs, path = fsspec.core.url_to_fs(old)
    assert not fs.exists(path)
    remove(old)  # removing what is gone is not an error


def test_probe_names_what_cannot_take_a_checkpoint(tmp_path):
    assert probe_writable(tmp_path / "new" / "dir") is None
    assert (tmp_path / "new" / "dir").is_dir()
    assert list((tmp_path / "new" / "dir").iterdir()) == []  # the probe file is gone
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert "cannot write there" in probe_writable(blocker / "checkpoints")
    assert "Protocol not known: nosuch" in probe_writable("nosuch://bucket/prefix")


def test_retention_never_counts_a_checkpoint_corrupted_at_its_size(root):
    """The audit's case: steps 10–40 saved, step 40's bytes flipped at the same size, a run
    resumed from 30 saves 35 with keep_last = 1. Only checksums tell 40 is bad: it is neither
    counted nor deleted, and 35, the newest good checkpoint, stays."""
    for step in (10, 20, 30, 35, 40):
        fake_checkpoint(root, step)
    write(join(root, "step_00000040/__0_0.distcp"), b"y" * 100)
    assert sorted(name_of(p) for p in retention_victims(root, 1)) == [
        "step_00000010",
        "step_00000020",
        "step_00000030",
    ]


def test_removing_a_symlinked_checkpoint_never_reaches_through_it(tmp_path):
    """A step directory that is a symlink to elsewhere: retention removes the link, and
    nothing behind it (it deleted the target's manifest)."""
    elsewhere = tmp_path / "elsewhere"
    target = fake_checkpoint(str(elsewhere), 4)
    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / "step_00000004").symlink_to(target, target_is_directory=True)
    fake_checkpoint(str(root), 8)
    remove(str(root / "step_00000004"))
    assert not (root / "step_00000004").exists()
    assert problem(target) is None  # the linked checkpoint is untouched


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda m: [m], "it is a JSON list, not an object"),
        (lambda m: {**m, "files": None}, "it lists no files, or not DCP's .metadata"),
        (lambda m: {**m, "files": {**m["files"], "": m["files"][".metadata"]}}, "named ''"),
        (lambda m: {**m, "files": {**m["files"], "../x": m["files"][".metadata"]}}, "'../x'"),
        (lambda m: {**m, "files": {**m["files"], "__0_0.distcp": {}}}, "has no size"),
        (lambda m: {**m, "files": {**m["files"], "__0_0.distcp": {"bytes": -1}}}, "has no size"),
        (lambda m: {**m, "files": {".metadata": {"bytes": 4, "sha256": "zz"}}}, "no SHA-256"),
        (lambda m: {**m, "step": "two"}, "its step is 'two', not a whole number"),
        (lambda m: {**m, "model": None}, "its model is None, not an object"),
    ],
)
def test_a_malformed_manifest_is_named_never_a_crash(root, change, reason):
    path = fake_checkpoint(root, 4)
    fs, manifest_path = fsspec.core.url_to_fs(join(path, MANIFEST))
    manifest = json.loads(fs.cat_file(manifest_path))
    write(join(path, MANIFEST), json.dumps(change(manifest)).encode())
    found = problem(path)
    assert found is not None and found.startswith("its manifest cannot be read (")
    assert reason in found
    assert retention_victims(root, 1) == [] and newest_good(root)[0] is None


@pytest.mark.parametrize(
    ("asked", "cuda", "hosts", "chosen", "said"),
    [
        ("auto", False, [], False, None),  # a CPU run: the copy competes with training
        ("auto", True, [("a", 4 << 30, 64 << 30), ("a", 4 << 30, 64 << 30)], True, None),
        ("auto", True, [("a", 30 << 30, 64 << 30), ("a", 30 << 30, 64 << 30)], False, "a's"),
        ("auto", True, [("a", 4 << 30, 64 << 30), ("b", 60 << 30, 64 << 30)], False, "b's"),
        (True, False, [], True, None),
        (False, True, [("a", 1, 1 << 40)], False, None),
    ],
)
def test_checkpoints_are_asynchronous_on_gpus_where_each_host_has_memory_for_the_copies(
    asked, cuda, hosts, chosen, said
):
    from shardwise.training.checkpoint.manager import asynchronous_by_default

    asynchronous, note = asynchronous_by_default(asked, cuda=cuda, hosts=hosts)
    assert asynchronous is chosen
    if said is None:
        assert note is None
    else:
        assert said in note and "checkpoint.async = true" in note


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_save_hashes_its_files_as_it_writes_them(tmp_path, where):
    """DCP's writer, wrapped: the checksums it took on the way are the files' own, so nothing
    is read back to write the manifest."""
    import torch
    import torch.distributed.checkpoint as dcp

    from shardwise.training.checkpoint.writer import digests, hashing_writer

    target = str(tmp_path / "ckpt") if where == "local" else f"memory://hash-{uuid.uuid4().hex}"
    state = {"w": torch.randn(1000, 100), "b": torch.arange(7), "step": 3, "rng": {"x": 1.5}}
    writer = hashing_writer(target)
    dcp.save(state, storage_writer=writer, no_dist=True)
    found = digests(writer)
    fs, path = fsspec.core.url_to_fs(target)
    names = sorted(name_of(p) for p in fs.ls(path, detail=False))
    assert sorted(found) == names and ".metadata" in names
    for name in names:
        assert found[name] == file_digest(join(target, name)), name
