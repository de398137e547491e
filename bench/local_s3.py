"""An S3-compatible server (moto) on a loopback port for the streaming benchmarks, with a bucket
`bench`; this process and the ones it starts reach it through the standard AWS variables."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def local_s3() -> Iterator[Any]:
    """Yields an fsspec filesystem of the server; the server stops on exit."""
    import fsspec
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(
        AWS_ENDPOINT_URL=f"http://{host}:{port}", AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
    )  # fmt: skip
    try:
        fs = fsspec.filesystem("s3", skip_instance_cache=True)
        fs.mkdir("bench")
        yield fs
    finally:
        server.stop()
