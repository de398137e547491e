"""Ray as shardwise uses it, for many-models and for training (`shardwise launch ray`): a local
instance on loopback only, and a cluster address checked in seconds before ray.init would retry
it for minutes."""

from __future__ import annotations

import contextlib
import logging
import re
import socket
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from shardwise.common.environment import environment
from shardwise.common.errors import ConfigError

RAY_CONNECT_TIMEOUT_S = 10.0
"""How long `--ray-address` may take to answer: ray.init retries an unreachable address for
minutes."""


def check_ray_address(address: str, where: str) -> None:
    """Refuse, within `RAY_CONNECT_TIMEOUT_S`, a cluster address where nothing answers (`where`:
    the setting that gave it, for the message). The address checked is the one ray.init would
    connect to (`auto` read from RAY_ADDRESS or the last `ray start` on this machine, localhost
    replaced by this node's address)."""
    from ray._private.services import canonicalize_bootstrap_address

    try:
        if address.startswith("ray://"):  # Ray Client; its default port is 10001
            rest = address.removeprefix("ray://")
            target = rest if re.search(r":[0-9]+$", rest) else f"{rest}:10001"
        else:
            target = canonicalize_bootstrap_address(address) or ""
    except ConnectionError:  # `auto` and no cluster to be found
        raise ConfigError(
            f"{where}: no running Ray cluster found (RAY_ADDRESS is unset and no `ray start` ran "
            "on this machine); start one, or give the head node's host:port"
        ) from None
    except ValueError:
        target = ""
    host, _, port = target.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")  # [IPv6]:port
    if not (host and port.isdigit() and 0 < int(port) < 65536):
        raise ConfigError(
            f"{where} is not an address; give the head node's host:port, ray://host:port or "
            'auto ("" starts a local Ray)'
        )
    reason = _connect_error(host, int(port), RAY_CONNECT_TIMEOUT_S)
    if reason:
        raise ConfigError(
            f"{where}: nothing answers at {host}:{port} ({reason}; waited up to "
            f"{RAY_CONNECT_TIMEOUT_S:g} s); start the cluster (ray start --head) or fix the address"
        )


def _connect_error(host: str, port: int, timeout: float) -> str:
    """Why no TCP connection to host:port opens within `timeout` ("" when one does), trying
    again while a head that is still starting refuses it."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(left, 0.01)):
                return ""
        except socket.gaierror as e:  # an unknown name stays unknown
            return e.strerror or str(e)
        except OSError as e:
            if isinstance(e, TimeoutError) or left < 0.5:
                return "timed out" if isinstance(e, TimeoutError) else e.strerror or str(e)
        time.sleep(0.25)


@contextlib.contextmanager
def ray_logs_to(path: Path) -> Iterator[None]:
    """Ray's own logging goes to `path`, not the console, where it came before shardwise's
    first line (its driver-side loggers: the token-authentication notice at every start,
    connection and shutdown messages). Around `ray.init(configure_logging=False)`, which clears
    the `ray` logger's handlers as it starts and logs its start from `ray._private`: that one
    logs to the file during the start, and the `ray` logger from then on."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in ("ray._private", "ray"):
        logger = logging.getLogger(name)
        for old in list(logger.handlers):  # Ray's, or an earlier run's file (its descriptor)
            logger.removeHandler(old)
            old.close()
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    yield
    ray_logger = logging.getLogger("ray")  # cleared by ray.init
    if handler not in ray_logger.handlers:
        ray_logger.addHandler(handler)


def loopback_ray(
    workers: Mapping[str, str] | None = None,
) -> contextlib.AbstractContextManager[None]:
    """A local Ray started inside listens on loopback only. This is Ray's single-machine mode
    (its default on macOS and Windows): the node's address is 127.0.0.1, and the GCS, raylet and
    workers bind to it instead of the machine's external address. The driver reads the switch
    when `ray` is first imported and the processes Ray starts read it from their environment:
    import ray inside, and start it inside. `workers`: more variables for the processes the
    instance starts (its workers among them), given at its start rather than as a job's runtime
    environment, for which Ray starts workers of its own and leaves idle those it started."""
    # Only inside: with it set, `ray start` refuses to join a cluster.
    return environment({**(workers or {}), _RAY_SINGLE_MACHINE: "0"})


_RAY_SINGLE_MACHINE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
