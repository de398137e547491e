"""An S3-compatible server (moto) on a loopback port for the streaming benchmarks, with a bucket
`bench`; this process and the ones it starts reach it through the standard AWS variables.

The server runs in a process of its own, as S3 does: in the benchmark's process its request
handling (Python) would take the interpreter lock from the reader it serves, which a reader of
real object storage never pays."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any


def _serve(conn: Connection) -> None:  # in the server's process
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    conn.send(server.get_host_and_port())
    with contextlib.suppress(EOFError):  # EOFError: the benchmark is gone
        conn.recv()  # until told to stop
    server.stop()


@contextlib.contextmanager
def local_s3() -> Iterator[Any]:
    """Yields an fsspec filesystem of the server; the server stops on exit."""
    import fsspec

    ours, theirs = multiprocessing.get_context("spawn").Pipe()
    process = multiprocessing.get_context("spawn").Process(target=_serve, args=(theirs,))
    process.start()
    try:
        if not ours.poll(60):
            raise RuntimeError("the local S3 server did not start within 60 s")
        host, port = ours.recv()
        os.environ.update(
            AWS_ENDPOINT_URL=f"http://{host}:{port}", AWS_ACCESS_KEY_ID="bench",
            AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
        )  # fmt: skip
        fs = fsspec.filesystem("s3", skip_instance_cache=True)
        fs.mkdir("bench")
        yield fs
    finally:
        with contextlib.suppress(OSError):  # a server that died has no pipe to read
            ours.send("stop")
        process.join(30)
        if process.is_alive():
            process.kill()
            process.join()
