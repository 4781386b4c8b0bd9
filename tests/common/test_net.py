"""tests/helpers/net.py: the ports servers in tests bind are never ones the kernel hands out meanwhile."""

import socket

from tests.helpers.net import _ephemeral_floor, free_port, free_ports


def test_ports_are_below_the_ephemeral_range_and_never_repeat():
    ports = free_ports(50) + [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(1024 < p < _ephemeral_floor() for p in ports)


def test_a_port_handed_out_is_bindable():
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
        sock.listen()
