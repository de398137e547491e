"""Which failed rank `shardwise train` names: the one that failed for its own reason, not the
ranks that failed because it died (their error files often carry the same second)."""

from __future__ import annotations

import json

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from shardwise.training.launch.agent import _first_failure
from shardwise.training.launch.outcome import WorkerFailed

GLOO_ECHO = (
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:538] Connection closed by peer "
    "[127.0.0.1]:41865 ... This is typically caused by a remote worker crashing."
)


def failure(tmp_path, rank: int, message: str, timestamp: int) -> ProcessFailure:
    path = tmp_path / f"error-{rank}.json"
    # the layout torch's ErrorHandler writes: the time in whole seconds
    extra = {"py_callstack": f"trace of rank {rank}", "timestamp": str(timestamp)}
    path.write_text(json.dumps({"message": {"message": message, "extraInfo": extra}}))
    return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=1, error_file=str(path))


def test_a_rank_s_own_error_is_named_over_the_echo_on_its_peers(tmp_path):
    failures = {
        0: failure(tmp_path, 0, f"RuntimeError: {GLOO_ECHO}", 1_700_000_000),
        1: failure(tmp_path, 1, "RuntimeError: injected failure in forward", 1_700_000_000),
    }
    named = _first_failure(ChildFailedError("train", failures))
    assert isinstance(named, WorkerFailed)
    assert str(named) == "rank 1 failed (exit code 1): RuntimeError: injected failure in forward"
    assert named.traceback == "trace of rank 1"


def test_otherwise_the_earliest_failure_is_named(tmp_path):
    failures = {
        0: failure(tmp_path, 0, "ValueError: late", 1_700_000_005),
        1: failure(tmp_path, 1, "ValueError: early", 1_700_000_001),
    }
    assert _first_failure(ChildFailedError("train", failures)).rank == 1  # type: ignore[attr-defined]
