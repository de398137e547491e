"""Where a job's processes meet, and on which addresses they listen.

torch's TCPStore listens on every interface, unauthenticated, whatever host it is given, and
gloo binds to the address the host name resolves to. A run on one machine needs none of that:
its stores (the elastic agents' rendezvous and rank 0's) listen on a socket bound to loopback
and handed to TCPStore, and gloo and NCCL use the loopback interface. A run across machines
binds its stores to the address the nodes meet at (the rendezvous endpoint, the address rank 0's
node is known by), not to every interface; its collectives use the interface the user names
(`GLOO_SOCKET_IFNAME`, `NCCL_SOCKET_IFNAME`).

This module must not decide who hosts what: training/run.py does.
"""

from __future__ import annotations

import contextlib
import os
import socket
from datetime import timedelta

from torch.distributed import Store, TCPStore  # type: ignore[attr-defined]
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousParameters,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
from torch.distributed.elastic.rendezvous.utils import (
    _matches_machine_hostname,
    parse_rendezvous_endpoint,
)

from shardwise.common.environment import environment

RENDEZVOUS = "shardwise-c10d"
"""torch elastic's c10d rendezvous, with its store bound to the endpoint's address."""
LOOPBACK = "127.0.0.1"


def host_store(
    host: str, port: int, *, world_size: int | None, timeout: timedelta, multi_tenant: bool
) -> TCPStore:
    """A TCPStore server listening on `host`'s address only (port 0: a free one)."""
    address = socket.gethostbyname(host)
    listener = socket.create_server((address, port), backlog=socket.SOMAXCONN)
    bound = listener.getsockname()[1]
    return TCPStore(
        host,
        bound,
        world_size,
        True,
        timeout,
        wait_for_workers=False,
        multi_tenant=multi_tenant,
        master_listen_fd=listener.detach(),  # the store owns the socket from here
    )


def register_rendezvous() -> None:
    """Make `RENDEZVOUS` available to torch elastic's agents (once per process)."""
    with contextlib.suppress(ValueError):  # registered already
        rendezvous_handler_registry.register(RENDEZVOUS, _rendezvous)


def _rendezvous(params: RendezvousParameters) -> RendezvousHandler:
    """torch's c10d rendezvous handler, over a store that listens on the endpoint's address
    (torch's own listens on every interface)."""
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=29400)
    hosts = params.get_as_bool("is_host")
    timeout = timedelta(seconds=params.get_as_int("read_timeout", 60) or 60)
    store: Store | None = None
    if hosts or (hosts is None and _matches_machine_hostname(host)):
        try:
            store = host_store(host, port, world_size=None, timeout=timeout, multi_tenant=True)
        except OSError:
            if hosts:  # told to host, and cannot: say so
                raise
            # another agent on this machine hosts it (as torch's own handler allows for)
    if store is None:
        store = TCPStore(host, port, is_master=False, multi_tenant=True, timeout=timeout)
    return create_handler(store, _Backend(store, params.run_id), params)


class _Backend(C10dRendezvousBackend):
    """torch's c10d rendezvous backend under the name it is registered with."""

    @property
    def name(self) -> str:
        return RENDEZVOUS


def worker_store(
    *, rank: int, world_size: int, host: str, port: int, timeout: timedelta
) -> TCPStore:
    """The store a job's workers meet at: rank 0 hosts it, listening on `host`'s address only."""
    if rank == 0:
        return host_store(host, port, world_size=world_size, timeout=timeout, multi_tenant=False)
    return TCPStore(host, port, world_size, False, timeout)


def loopback_collectives() -> contextlib.AbstractContextManager[None]:
    """gloo and NCCL on the loopback interface, for workers started inside (unless the user
    chose an interface)."""
    names = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
    chosen = {
        var: names[0]
        for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
        if names and var not in os.environ
    }
    return environment(chosen)
