"""Two simulated machines on one: Linux network namespaces joined by a veth pair, each with its own
address, interfaces and ports. Needs root and iproute2; `two_nodes` skips the test (with the
reason) where namespaces cannot be made."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class Node:
    namespace: str
    addr: str
    interface: str

    def command(self, *argv: str) -> list[str]:
        """`argv` run inside this node's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def free_port(self) -> int:
        """A port free on this node (a new namespace has no listeners, but ask rather than
        assume): bind port 0 there and read what the kernel gave."""
        probe = (
            "import socket; s = socket.socket(); "
            f"s.bind(({self.addr!r}, 0)); print(s.getsockname()[1])"
        )
        out = subprocess.run(
            self.command(sys.executable, "-c", probe), capture_output=True, text=True, check=True
        )
        return int(out.stdout)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextmanager
def two_nodes() -> Iterator[tuple[Node, Node]]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("simulating two nodes needs root and iproute2 (`ip netns`)")
    tag = f"sw{os.getpid()}"
    subnet = f"10.231.{os.getpid() % 250}"
    nodes = (Node(f"{tag}-a", f"{subnet}.1", f"{tag}a"), Node(f"{tag}-b", f"{subnet}.2", f"{tag}b"))
    try:
        _ip("netns", "add", nodes[0].namespace)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot create a network namespace here: {e.stderr.strip()}")
    try:
        _ip("netns", "add", nodes[1].namespace)
        _ip("link", "add", nodes[0].interface, "type", "veth", "peer", "name", nodes[1].interface)
        for node in nodes:
            _ip("link", "set", node.interface, "netns", node.namespace)
            _ip("-n", node.namespace, "addr", "add", f"{node.addr}/24", "dev", node.interface)
            _ip("-n", node.namespace, "link", "set", node.interface, "up")
            _ip("-n", node.namespace, "link", "set", "lo", "up")
        yield nodes
    finally:
        for node in nodes:
            _kill_everything_in(node.namespace)
            subprocess.run(
                ["ip", "netns", "del", node.namespace], capture_output=True
            )  # and its veth end


def _kill_everything_in(namespace: str) -> None:
    found = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    for pid in found.stdout.split():
        with suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
