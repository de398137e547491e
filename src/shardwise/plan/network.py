"""The network between nodes as `shardwise plan --link GBPS[,LATENCY_MS]` gives it: its
bandwidth each direction and one-way latency, parsed and checked, and the hardware it makes.
What the data-parallel modes cost on it is comm_modes.py's."""

from __future__ import annotations

from dataclasses import dataclass, replace

from shardwise.common.errors import ConfigError
from shardwise.plan.bounds import Bound, message_text
from shardwise.plan.hardware import Hardware

LINK_GBPS = Bound(0, 1e6, above=True, means="Gbit/s between nodes, each direction")
LINK_LATENCY_MS = Bound(0, 60_000, means="milliseconds, one way")


@dataclass(frozen=True)
class Network:
    """The link between nodes: what one node sends to the others per second in each direction
    (a ring all-reduce across nodes gets all of it), and its one-way latency."""

    gbps: float
    latency_ms: float | None = None
    """None: the hardware's own latency across nodes."""

    @property
    def bandwidth(self) -> float:
        """Bytes/s."""
        return self.gbps * 1e9 / 8

    def apply(self, hardware: Hardware) -> Hardware:
        """`hardware` with this network between its nodes. A message across pays the network's
        latency on top of the collective library's own (the hardware's latency inside a node);
        a link faster than the node's own is limited by the node's."""
        latency = hardware.inter_latency
        if self.latency_ms is not None:
            latency = hardware.intra_latency + self.latency_ms / 1e3
        return replace(
            hardware,
            inter_bandwidth=min(self.bandwidth, hardware.intra_bandwidth),
            inter_latency=latency,
        )

    def describe(self) -> str:
        latency = "" if self.latency_ms is None else f", {self.latency_ms:g} ms one way"
        return f"{self.gbps:g} Gbit/s each direction{latency}"


def parse_link(text: str, label: str = "--link") -> Network:
    """`GBPS` or `GBPS,LATENCY_MS` as typed; ConfigError naming `label` and what it takes."""
    fields = text.split(",")
    try:
        if len(fields) > 2:
            raise ConfigError("more than two fields")
        gbps = float(LINK_GBPS.parse(fields[0].strip(), label))
        latency = None
        if len(fields) == 2:
            latency = float(LINK_LATENCY_MS.parse(fields[1].strip(), label))
    except ConfigError:
        raise ConfigError(
            f"{label} {message_text(text)}: must be {LINK_GBPS.allowed()} ({LINK_GBPS.means}), "
            f"optionally followed by a comma and {LINK_LATENCY_MS.allowed()} "
            f"({LINK_LATENCY_MS.means}), e.g. {label} 100,0.01"
        ) from None
    return Network(gbps, latency)
