"""Secrets never leave memory: credentials in URIs are redacted wherever shardwise shows or stores
text (the console, error lines, `config.toml`, many-models' `job.toml`, MLflow params, export and
checkpoint metadata).

A credential is the user-info part of a URI (`http://user:pass@host`, `s3://key:secret@bucket`,
`https://token@host`) or the value of a query parameter whose name says it is one
(`?token=…`, `&X-Amz-Signature=…`, `?password=…`). The configuration in memory keeps them: the
processes that connect need them.
"""

from __future__ import annotations

import io
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO, TypeVar

HIDDEN = "***"
# scheme://user:password@ (a secret may hold a "/", as AWS secret keys do, though RFC 3986 says
# it must be escaped: better to hide a path with a port and an "@" than to show a key) or
# scheme://token@ (RFC 3986: the authority ends at the first /, ? or #)
_USERINFO = re.compile(
    r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)"
    r"(?:[^\s/?#@:'\"]*:[^\s@'\"]*|[^\s/?#@'\"]+)@"
)
_SECRET_PARAM = re.compile(
    r"(?P<name>[?&;][^=&\s#'\"]*"
    r"(?:token|secret|passw(?:or)?d|pwd|api[_-]?key|access[_-]?key|signature|credential|auth)"
    r"[^=&\s#'\"]*=)[^&\s#'\"]+",
    re.IGNORECASE,
)

T = TypeVar("T")


def redact(text: str) -> str:
    """`text` with every credential in a URI replaced by `***`."""
    if "://" not in text and "=" not in text:
        return text
    text = _USERINFO.sub(rf"\g<scheme>{HIDDEN}@", text)
    return _SECRET_PARAM.sub(rf"\g<name>{HIDDEN}", text)


def redacted(value: T) -> T:
    """`value` (strings in nested dicts, lists and tuples) with credentials redacted."""
    found: Any = value
    if isinstance(found, str):
        found = redact(found)
    elif isinstance(found, dict):
        found = {k: redacted(v) for k, v in found.items()}
    elif isinstance(found, list | tuple):
        found = type(found)(redacted(v) for v in found)
    return found  # type: ignore[no-any-return]


class RedactingStream(io.TextIOBase):
    """A text stream that writes to `inner` with credentials redacted, line by line whole (a
    URI split across two writes is still caught); everything else is the inner stream's."""

    def __init__(self, inner: TextIO) -> None:
        super().__init__()
        self.inner = inner
        self._pending = ""

    def write(self, text: str) -> int:
        lines = (self._pending + text).split("\n")
        self._pending = lines.pop()
        if lines:
            self.inner.write(redact("\n".join(lines) + "\n"))
        if self._pending and ("\r" in self._pending or len(self._pending) > 65536):
            self._flush_pending()  # a progress line redrawn in place, or no line end coming
        return len(text)

    def _flush_pending(self) -> None:
        if self._pending:
            self.inner.write(redact(self._pending))
            self._pending = ""

    def flush(self) -> None:
        self._flush_pending()
        self.inner.flush()

    def isatty(self) -> bool:
        return self.inner.isatty()

    def fileno(self) -> int:
        return self.inner.fileno()

    def writable(self) -> bool:
        return True

    @property
    def buffer(self) -> Any:  # bytes written here are the writer's business (and not redacted)
        return self.inner.buffer

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self.inner.encoding

    @property
    def errors(self) -> str | None:  # type: ignore[override]
        return self.inner.errors


@contextmanager
def redacting_output() -> Iterator[None]:
    """`sys.stdout` and `sys.stderr` redact credentials while inside: everything this process
    prints (rich consoles, warnings, error lines) goes through them."""
    if isinstance(sys.stdout, RedactingStream):  # already (a worker started from the CLI)
        yield
        return
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = RedactingStream(saved[0]), RedactingStream(saved[1])
    try:
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        sys.stdout, sys.stderr = saved
