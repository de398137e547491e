"""Checkpoint integrity without torch: manifests with sizes and checksums, damaged checkpoints
named and skipped, retention that never deletes the last good checkpoint."""

from __future__ import annotations

import json

from shardwise.checkpoint.layout import (
    MANIFEST,
    file_digest,
    newest_good,
    problem,
    retention_victims,
)


def fake_checkpoint(root, step, payload=b"x" * 100):
    path = root / f"step_{step:08d}"
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(payload)
    (path / ".metadata").write_bytes(b"meta")
    files = {name: file_digest(path / name) for name in ("__0_0.distcp", ".metadata")}
    (path / MANIFEST).write_text(json.dumps({"step": step, "files": files}))
    return path


def test_good_truncated_corrupted_and_interrupted(tmp_path):
    good = fake_checkpoint(tmp_path, 4)
    assert problem(good) is None
    truncated = fake_checkpoint(tmp_path, 8)
    (truncated / "__0_0.distcp").write_bytes(b"x" * 10)
    assert problem(truncated) == "__0_0.distcp is 10 bytes, the manifest says 100 (truncated)"
    corrupted = fake_checkpoint(tmp_path, 12)
    (corrupted / "__0_0.distcp").write_bytes(b"y" * 100)
    assert problem(corrupted) == "__0_0.distcp does not match its checksum (corrupted)"
    assert problem(corrupted, checksums=False) is None
    interrupted = fake_checkpoint(tmp_path, 16)
    (interrupted / MANIFEST).unlink()
    assert "no manifest" in problem(interrupted)

    path, skipped = newest_good(tmp_path)
    assert path == good
    assert [s.split(":")[0] for s in skipped] == [
        "skipping checkpoint step_00000016",
        "skipping checkpoint step_00000012",
        "skipping checkpoint step_00000008",
    ]


def test_retention_keeps_the_last_good_checkpoint(tmp_path):
    for step in (4, 8, 12):
        fake_checkpoint(tmp_path, step)
    assert [p.name for p in retention_victims(tmp_path, 2)] == ["step_00000004"]
    # the newest is damaged: it does not count, so step 8 and 4 are both kept with keep_last=1…
    (tmp_path / "step_00000012" / "__0_0.distcp").write_bytes(b"")
    assert [p.name for p in retention_victims(tmp_path, 1)] == ["step_00000004"]
    # …and with keep_last=2 nothing good is deleted
    assert retention_victims(tmp_path, 2) == []
