"""Loopback ports for servers started by tests.

A port found free is closed again before the server binds it, so the kernel must not hand it to anyone else in
between: ports come from below the kernel's ephemeral range (which bind(0) and outgoing connections draw from),
each at most once per test session, starting at an offset derived from the pid so concurrent sessions differ.
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


_CEILING = max(_FLOOR + 1_000, _ephemeral_floor())
_SPAN = _CEILING - _FLOOR
_start = (os.getpid() * 7_919) % _SPAN
_candidates = (_FLOOR + (_start + i) % _SPAN for i in itertools.count())


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
