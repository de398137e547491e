"""Two simulated machines on one: Linux network namespaces joined by a link, each with its own
address, interfaces and ports. Needs root and iproute2; `two_nodes` skips the test (with the
reason) where namespaces cannot be made.

The link is a veth pair, or a slow network: `two_nodes(mbit=…, delay_ms=…)` caps each direction
at `mbit` with a token bucket (`tc qdisc … tbf`) on each end's egress and delays every packet by
`delay_ms` one way (a round trip by twice that). The kernel here is built without netem
(CONFIG_NET_SCH_NETEM) and without fq, which a BPF program's delivery times would need, so the
delay is made in user space: with `delay_ms` > 0 the nodes are joined by two tun devices and a
delay line, a process that reads each packet from one, holds it `delay_ms` and writes it to the
other. It costs about 15% of a core at 100 Mbit/s and carries at most about 750 Mbit/s here.
`measure_transfer` and `measure_rtt` send real data between the nodes, to show what the link
does."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import statistics
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass

import pytest

MTU = 1500
QUEUE_S = 0.05
"""The token bucket queues up to this long at the link's rate (50 ms: 625 KB at 100 Mbit/s)
before it drops: deep enough that several TCP flows (every pair of ranks across the link has its
own) share it without loss, shallow enough that a small message behind a full queue is not
delayed by seconds."""


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

    def kill_everything(self) -> None:
        """SIGKILL every process in this node's namespace (whatever a run left behind)."""
        _kill_everything_in(self.namespace)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextmanager
def two_nodes(*, mbit: float | None = None, delay_ms: float = 0.0) -> Iterator[tuple[Node, Node]]:
    """Two nodes joined by a link: a veth pair, or (with `delay_ms` > 0) a delay line; `mbit`
    caps the rate of each direction. Everything started in the nodes is killed on exit."""
    if mbit is not None and not 0 < mbit <= 100_000:
        raise ValueError(f"mbit must be in (0, 100000], got {mbit}")
    if not 0 <= delay_ms <= 10_000:
        raise ValueError(f"delay_ms must be in [0, 10000], got {delay_ms}")
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("simulating two nodes needs root and iproute2 (`ip netns`)")
    if mbit is not None and shutil.which("tc") is None:
        pytest.skip("shaping the link needs `tc` (iproute2)")
    tag = f"sw{os.getpid()}"
    subnet = f"10.231.{os.getpid() % 250}"
    nodes = (Node(f"{tag}-a", f"{subnet}.1", f"{tag}a"), Node(f"{tag}-b", f"{subnet}.2", f"{tag}b"))
    try:
        _ip("netns", "add", nodes[0].namespace)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot create a network namespace here: {e.stderr.strip()}")
    delay_line = None
    try:
        _ip("netns", "add", nodes[1].namespace)
        if delay_ms > 0:
            delay_line = _start_delay_line(nodes, delay_ms)
        else:
            ends = [node.interface for node in nodes]
            _ip("link", "add", ends[0], "type", "veth", "peer", "name", ends[1])
        for node in nodes:
            _ip("link", "set", node.interface, "netns", node.namespace)
            _ip("-n", node.namespace, "addr", "add", f"{node.addr}/24", "dev", node.interface)
            _ip("-n", node.namespace, "link", "set", node.interface, "mtu", str(MTU), "up")
            _ip("-n", node.namespace, "link", "set", "lo", "up")
            if mbit is not None:
                _limit_rate(node, mbit)
        yield nodes
    finally:
        for node in nodes:
            _kill_everything_in(node.namespace)
        if delay_line is not None:  # its tun devices go with it
            _stop(delay_line)
        for node in nodes:
            subprocess.run(
                ["ip", "netns", "del", node.namespace], capture_output=True
            )  # and its end of the link


def _limit_rate(node: Node, mbit: float) -> None:
    """A token bucket on `node`'s egress: at most `mbit` out of it, a queue of `QUEUE_S` at that
    rate. TCP hands the device segments of up to 64 KB (segmentation offload) that the bucket
    sends whole; they are capped at about 1 ms at the rate so the link is not bursty."""
    rate = mbit * 1e6 / 8  # bytes/s
    largest = int(min(65536, max(2 * MTU, rate * 1e-3)))
    _ip("-n", node.namespace, "link", "set", node.interface, "gso_max_size", str(largest))
    burst = largest + MTU  # at least the largest packet, or the bucket drops or splits it
    limit = int(max(4 * burst, rate * QUEUE_S))
    tbf = ["rate", f"{mbit * 1e6:.0f}bit", "burst", str(burst), "limit", str(limit)]
    subprocess.run(
        node.command("tc", "qdisc", "replace", "dev", node.interface, "root", "tbf", *tbf),
        check=True,
        capture_output=True,
        text=True,
    )


def queue_stats(node: Node) -> dict[str, int]:
    """The counters of the queue on `node`'s egress (`tc -s qdisc`): bytes, packets, drops,
    overlimits (packets that waited for tokens) and requeues."""
    out = subprocess.run(
        node.command("tc", "-s", "-j", "qdisc", "show", "dev", node.interface),
        check=True,
        capture_output=True,
        text=True,
    )
    root = next(q for q in json.loads(out.stdout) if q.get("root"))
    keys = ("bytes", "packets", "drops", "overlimits", "requeues")
    return {key: int(root.get(key, 0)) for key in keys}


# The delay line: two tun devices created here, in the root namespace (the caller moves each into
# its node), and a loop that copies packets from one to the other `delay` seconds after they
# arrive. With a virtio-net header on each packet the devices take TCP segmentation offload, so a
# packet is up to 64 KB (1 ms at the rate where the rate is capped) and there are few to copy;
# the header is copied with the packet.
# Round-robin real-time priority keeps the training processes sharing the cores from delaying it.
_DELAY_LINE = r"""
import collections, fcntl, os, select, struct, sys, time
TUNSETIFF, TUNSETOFFLOAD = 0x400454CA, 0x400454D0
IFF_TUN, IFF_NO_PI, IFF_VNET_HDR = 0x0001, 0x1000, 0x4000
TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6 = 0x01, 0x02, 0x04
names, delay = sys.argv[1:3], float(sys.argv[3])
flags, fds = IFF_TUN | IFF_NO_PI | IFF_VNET_HDR, []
for name in names:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), flags))
    fcntl.ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6)
    fds.append(fd)
other = {fds[0]: fds[1], fds[1]: fds[0]}
try:
    os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(10))
except OSError:
    pass
print("ready", flush=True)
line = collections.deque()  # (due, fd to write, packet): one delay, so due times are in order
while True:
    wait = max(0.0, line[0][0] - time.monotonic()) if line else None
    readable, _, _ = select.select(fds, [], [], wait)
    now = time.monotonic()
    for fd in readable:
        while True:
            try:
                packet = os.read(fd, 65536 + 64)
            except BlockingIOError:
                break
            line.append((now + delay, other[fd], packet))
    while line and line[0][0] <= now:
        _, fd, packet = line.popleft()
        try:
            os.write(fd, packet)
        except OSError:  # a device gone (the nodes are being torn down) or a packet refused
            pass
"""


def _start_delay_line(nodes: tuple[Node, Node], delay_ms: float) -> subprocess.Popen[str]:
    names = [node.interface for node in nodes]
    process = subprocess.Popen(
        [sys.executable, "-c", _DELAY_LINE, *names, str(delay_ms / 1000)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ready = _read_line(process, timeout=30)
    except BaseException:
        _stop(process)
        raise
    if ready != "ready":
        _, err = _stop(process)
        raise RuntimeError(f"the delay line did not start: {err.strip() or ready}")
    return process


def _read_line(process: subprocess.Popen[str], timeout: float) -> str:
    """The next line `process` prints, or "" if it prints none within `timeout` or exits."""
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    return process.stdout.readline().strip() if ready else ""


def _stop(process: subprocess.Popen[str]) -> tuple[str, str]:
    """Kill `process` if it still runs, reap it, and return what it printed."""
    if process.poll() is None:
        process.kill()
    out, err = process.communicate()
    return out or "", err or ""


def _kill_everything_in(namespace: str) -> None:
    found = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    for pid in found.stdout.split():
        with suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


# Measurements: a server on one node (it binds port 0 and prints the port the kernel gave, so no
# port is fixed or guessed), a client on the other that prints what it timed.
_SINK = r"""
import socket, sys
server = socket.socket()
server.bind((sys.argv[1], 0))
server.listen(1)
server.settimeout(float(sys.argv[3]))
print(server.getsockname()[1], flush=True)
peer, _ = server.accept()
peer.settimeout(float(sys.argv[3]))
left, buffer = int(sys.argv[2]), bytearray(1 << 20)
while left:
    got = peer.recv_into(buffer, min(len(buffer), left))
    if not got:
        raise SystemExit(f"the sender closed with {left} bytes still to come")
    left -= got
peer.sendall(b"k")
"""
_SOURCE = r"""
import socket, sys, time
peer = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[4]))
chunk, left = memoryview(bytes(1 << 20)), int(sys.argv[3])
began = time.perf_counter()
while left:
    peer.sendall(chunk[: min(len(chunk), left)])
    left -= min(len(chunk), left)
assert peer.recv(1) == b"k"
print(time.perf_counter() - began)
"""
_ECHO = r"""
import socket, sys
server = socket.socket()
server.bind((sys.argv[1], 0))
server.listen(1)
server.settimeout(float(sys.argv[3]))
print(server.getsockname()[1], flush=True)
peer, _ = server.accept()
peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while message := peer.recv(64):
    peer.sendall(message)
"""
_PING = r"""
import json, socket, sys, time
peer = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[4]))
peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for _ in range(int(sys.argv[3]) + 2):  # the first two warm up
    began = time.perf_counter()
    peer.sendall(b"x" * 64)
    got = 0
    while got < 64:
        got += len(peer.recv(64 - got))
    rtts.append(time.perf_counter() - began)
    time.sleep(0.01)
print(json.dumps(rtts[2:]))
"""


def _between(server: Node, client: Node, programs: tuple[str, str], *args: str) -> str:
    """Start the server program on `server` (argv: its address, then `args`), then the client
    program on `client` (argv: the server's address and port, then `args`); return what the
    client printed. The last of `args` is the timeout in seconds. Both are killed on the way out,
    whatever happens."""
    server_code, client_code = programs
    started = subprocess.Popen(
        server.command(sys.executable, "-c", server_code, server.addr, *args),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        port = _read_line(started, timeout=30)
        if not port.isdigit():
            raise RuntimeError(f"the server on {server.namespace} did not start: {_stop(started)}")
        done = subprocess.run(
            client.command(sys.executable, "-c", client_code, server.addr, port, *args),
            capture_output=True,
            text=True,
            timeout=float(args[-1]) + 10,
        )
        if done.returncode != 0:
            raise RuntimeError(f"the client on {client.namespace} failed: {done.stderr.strip()}")
        return done.stdout
    finally:
        _stop(started)


def measure_transfer(a: Node, b: Node, nbytes: int, timeout: float = 120) -> tuple[float, float]:
    """Send `nbytes` over one TCP connection from `a` to `b`: (seconds from the first byte sent
    to b's acknowledgement of the last, megabits per second)."""
    out = _between(b, a, (_SINK, _SOURCE), str(nbytes), str(timeout))
    seconds = float(out)
    return seconds, nbytes * 8 / seconds / 1e6


def measure_rtt(a: Node, b: Node, count: int = 20, timeout: float = 60) -> float:
    """Ping over TCP: the median milliseconds a 64-byte message takes from `a` to `b` and back
    (`count` round trips, 10 ms apart, after two that warm up)."""
    out = _between(b, a, (_ECHO, _PING), str(count), str(timeout))
    return float(statistics.median(json.loads(out))) * 1e3
