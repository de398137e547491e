"""Imported by the ranks' forkserver last (PRELOAD's last entry): everything the server
has imported moves to the garbage collector's permanent generation (`gc.freeze`).

A forked rank shares the server's memory until it writes to it, and Python's collector writes to
every object it examines: a rank's first full collection would walk the server's objects (torch,
torch._dynamo, the trainer), copy every page that holds them and free none. CPython's
documentation of `gc.freeze` advises this for a process that forks without exec; what the server
imported lives as long as a rank anyway (docs/benchmarks.md, "Launch costs").
"""

from __future__ import annotations

import gc

gc.freeze()
