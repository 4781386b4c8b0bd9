"""Loopback ports for servers started by tests.

A port found free is closed again before the server binds it, so the kernel must not hand it to anyone else in
between: ports come from below the kernel's ephemeral range (which bind(0) and outgoing connections draw from),
each at most once per test session, starting at an offset derived from the pid so concurrent sessions differ.
Each xdist worker of one session draws from its own share of the range, so two workers never probe the same port.
"""

import itertools
import os
import socket
from pathlib import Path

_FLOOR = 10_000


def _ephemeral_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def _share() -> tuple[int, int]:
    """(first port, number of ports) of this process's share: the whole range, or one xdist worker's part."""
    ceiling = max(_FLOOR + 1_000, _ephemeral_floor())
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    span = (ceiling - _FLOOR) // max(workers, 1)
    return _FLOOR + worker * span, span


_BASE, _SPAN = _share()
_start = (os.getpid() * 7_919) % _SPAN
_candidates = (_BASE + (_start + i) % _SPAN for i in itertools.count())


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(n: int) -> list[int]:
    """n distinct loopback ports that are free now and that this session has never handed out before."""
    ports = []
    for port in itertools.islice(_candidates, _SPAN):
        if _bindable(port):
            ports.append(port)
            if len(ports) == n:
                return ports
    raise AssertionError("no free loopback port below the ephemeral range")


def free_port() -> int:
    return free_ports(1)[0]
