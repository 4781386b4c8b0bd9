"""Loopback ports for servers started by tests."""

import socket


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (the sockets are held together, so no port comes twice)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def free_port() -> int:
    return free_ports(1)[0]
