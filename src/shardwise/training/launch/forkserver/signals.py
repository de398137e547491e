"""Imported by the ranks' forkserver alone (PRELOAD's first entry): the server ignores
SIGTERM.

A scheduler stopping a job (Slurm's requeue or time limit, systemd, a process-group kill) sends
SIGTERM to every process of it, the server included. The launcher learns how each rank ended
through the server, so a server that died on the signal would report ranks still saving their
checkpoint as dead (exit 255): the launcher would stop waiting and the scheduler kill them
midway. Ignoring it, the server lives while the launcher does (it ends when the launcher has
gone). A rank forked from it restores the default at once (`restore_sigterm`).
"""

from __future__ import annotations

import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)
