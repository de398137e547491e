"""Process limits for the work a Ray task or actor runs: one thread per BLAS, OpenMP and torch
(tasks share the cores), and an address-space cap (`runner.memory_mb`) that turns an allocation
beyond it into a MemoryError in the series that made it."""

from __future__ import annotations

import os
import resource
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def one_thread(*, torch_too: bool) -> Iterator[None]:
    """Tasks share the cores: BLAS, OpenMP and (when a model uses it) torch get one thread each.
    torch is imported only then: importing it costs a new worker process a second or two."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1):
        if not torch_too:
            yield
            return
        import torch

        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(before)


@contextmanager
def memory_cap(megabytes: int) -> Iterator[None]:
    """Limit this process's address space to its current size + `megabytes` while the chunk runs:
    an allocation beyond it raises MemoryError in the series that made it."""
    if not megabytes:
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as statm:
        current = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = current + megabytes * 2**20
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
