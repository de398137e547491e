"""Imported by the ranks' forkserver last (PRELOAD's last entry): everything the server
has imported moves to the garbage collector's permanent generation (`gc.freeze`).

A forked rank shares the server's memory until it writes to it, and Python's collector writes to
every object it examines. A rank's first full collection (the one at the end of its run, before
its process group goes, or one its allocations set off mid-run) walked the server's 300,000
objects (torch, torch._dynamo, the trainer), copied every page that holds them and freed none:
0.28 CPU-s and about 80 MB per rank, measured, against 1 ms with them frozen. This is what
CPython's documentation of `gc.freeze` advises for a process that forks without exec. A frozen
object is never collected; what the server imported lives as long as a rank anyway, and a
rank's own objects are collected as before.
"""

from __future__ import annotations

import gc

gc.freeze()
