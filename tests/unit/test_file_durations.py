"""tests/file_durations.json orders `make test`'s files, the longest first (conftest.py)."""

import json

from helpers import REPO


def test_every_file_timed_exists_and_the_slowest_run_first():
    seconds = json.loads((REPO / "tests" / "file_durations.json").read_text())
    assert all((REPO / path).is_file() for path in seconds), "regenerate: tests/file_durations.py"
    assert list(seconds.values()) == sorted(seconds.values(), reverse=True)
    assert seconds["tests/e2e/test_launch_spark.py"] > 60  # a file of one long test
