"""Starting a helper process with spawn without running the caller's script again in it.

spawn imports the parent's `__main__` in the child (by module name, or by file): a script that
calls shardwise's Python API without an `if __name__ == "__main__":` guard would start its whole
job again in every helper, and one with a guard still has the child import everything the
script imports (the `shardwise` console script: the CLI). The helpers shardwise starts (chunk
workers, the MLflow tracker) run functions of shardwise's own modules and take what they need as
arguments, so they never need `__main__`.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def without_main_module() -> Iterator[None]:
    """Processes started with spawn inside this block do not import `__main__`."""
    main = sys.modules["__main__"]
    saved: dict[str, Any] = {
        name: main.__dict__[name] for name in ("__file__", "__spec__") if name in main.__dict__
    }
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.update(saved)
        if "__spec__" not in saved:
            del main.__spec__
