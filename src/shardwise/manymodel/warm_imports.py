"""What the chunk workers' fork server imports before it forks them (local_tasks.py): the
modules named in `WARM_ENV` (comma-separated: the chunk runner and the models' libraries), so
that they are imported once, not once per worker. A module that fails to import is left: the
worker building its model says what is wrong."""

from __future__ import annotations

import contextlib
import importlib
import os

WARM_ENV = "SHARDWISE_WARM_IMPORTS"


def warm(names: list[str]) -> None:
    """Import `names`, each where it can be."""
    for name in names:
        with contextlib.suppress(Exception):
            importlib.import_module(name)


warm([name for name in os.environ.get(WARM_ENV, "").split(",") if name])
