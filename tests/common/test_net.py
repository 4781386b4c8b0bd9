"""tests/helpers/net.py: the ports servers in tests bind are never ones the kernel hands out meanwhile."""

import socket

from tests.helpers.net import _ephemeral_floor, _share, free_port, free_ports


def test_ports_are_below_the_ephemeral_range_and_never_repeat():
    ports = free_ports(50) + [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(1024 < p < _ephemeral_floor() for p in ports)


def test_a_port_handed_out_is_bindable():
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
        sock.listen()


def test_xdist_workers_draw_from_disjoint_shares(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    shares = []
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        base, span = _share()
        shares.append(set(range(base, base + span)))
    assert shares[0] and shares[1] and not shares[0] & shares[1]
    assert all(1024 < p < _ephemeral_floor() for p in shares[0] | shares[1])
