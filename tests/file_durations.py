"""Write tests/file_durations.json, each test file's seconds in a measured run, from that run's
JUnit XML (`pytest ... --junitxml=FILE`):

    python tests/file_durations.py FILE

conftest.py runs the longest files first from it, so that two pytest workers end together
instead of one running the last long file alone. A file it does not list runs after those it
does, in pytest's order: regenerate it when a file's time moves by a minute or more."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(junit: str) -> None:
    seconds: Counter[str] = Counter()
    for case in ET.parse(junit).iter("testcase"):
        parts = case.get("classname", "").split(".")  # tests.e2e.test_x, or with a class after
        paths = ("/".join(parts[:n]) + ".py" for n in range(len(parts), 0, -1))
        path = next((p for p in paths if (HERE.parent / p).is_file()), None)
        if path is not None:
            seconds[path] += float(case.get("time") or 0)
    table = {path: round(s) for path, s in sorted(seconds.items(), key=lambda kv: -kv[1])}
    (HERE / "file_durations.json").write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
