"""CacheStoreClient: rendezvous sharding over real `ragserve cachestore` processes, dead and slow replicas."""

import signal
import socket
import threading
import time

import grpc
import pytest

from ragserve.v1 import cachestore_pb2 as pb
from ragserve.v1 import cachestore_pb2_grpc as pb_grpc
from ragserve_cachestore.client import CacheStoreClient, KVBlock
from ragserve_cachestore.sharding import parse_addresses, rendezvous_owner
from tests.helpers.cachestore import LAYOUT, chain, kv_blocks
from tests.helpers.process import until


def stored_on(address: str, keys: list[bytes]) -> list[bool]:
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.CacheStoreStub(channel)
        return [stub.Lookup(pb.LookupRequest(layout=LAYOUT, keys=[k]), timeout=5).prefix_len == 1 for k in keys]


def test_rendezvous_balances_and_moves_only_the_removed_replicas_keys():
    addresses = ["10.0.0.1:50061", "10.0.0.2:50061", "10.0.0.3:50061"]
    keys = chain(3000)
    owners = [addresses[rendezvous_owner(k, addresses)] for k in keys]
    for address in addresses:
        assert 800 < owners.count(address) < 1200
    survivors = addresses[:2]
    for key, owner in zip(keys, owners, strict=True):
        if owner in survivors:
            assert survivors[rendezvous_owner(key, survivors)] == owner


def test_addresses_and_blocks_are_validated():
    assert parse_addresses("a:1, b:2,a:1") == ["a:1", "b:2"]
    for bad in ("", "nohost", ":80", "host:x", "host:70000"):
        with pytest.raises(ValueError, match="HOST:PORT|at least one"):
            parse_addresses(bad)
    with pytest.raises(ValueError, match="32 hex chars"):
        CacheStoreClient(["127.0.0.1:1"], "not-a-layout")
    with CacheStoreClient(["127.0.0.1:1"], LAYOUT) as client:
        with pytest.raises(ValueError, match="32 bytes"):
            client.put([KVBlock(b"short", b"\0\0", "int8", (2,))])
        with pytest.raises(ValueError, match="needs 4"):
            client.put([KVBlock(chain(1)[0], b"\0\0", "float16", (2,))])
        with pytest.raises(ValueError, match="32 bytes"):
            client.lookup([b"short"])


def test_sharding_across_two_processes_then_a_dead_replica_is_skipped_and_used_again(cachestore_process, tmp_path):
    disk_only = ("--memory", "0", "--disk", "64MiB")  # every block on disk, so it outlives a kill
    a = cachestore_process(*disk_only, "--disk-dir", str(tmp_path / "a"))
    b = cachestore_process(*disk_only, "--disk-dir", str(tmp_path / "b"))
    blocks = kv_blocks(64, 2048)
    keys = [blk.key for blk in blocks]
    client = CacheStoreClient([a.address, b.address], LAYOUT, timeout_s=2.0, backoff_s=0.2, max_backoff_s=1.0)
    try:
        assert client.put(blocks) == 64
        owners = [rendezvous_owner(k, client.addresses) for k in keys]
        assert stored_on(a.address, keys) == [o == 0 for o in owners]
        assert stored_on(b.address, keys) == [o == 1 for o in owners]
        assert client.lookup(keys) == 64 and client.get(keys) == blocks
        assert {addr: s.puts for addr, s in client.stats().items()} == {
            a.address: owners.count(0),
            b.address: owners.count(1),
        }

        b.stop(signal.SIGKILL)
        first_on_b = owners.index(1)
        assert client.lookup(keys) == first_on_b  # b's blocks are misses; no exception
        assert client.get(keys) == blocks[:first_on_b]
        more = kv_blocks(20, 2048, seed="more")
        more_on_a = sum(rendezvous_owner(blk.key, client.addresses) == 0 for blk in more)
        put = client.put_blocks(more)
        assert (put.stored, put.accepted_bytes) == (more_on_a, more_on_a * 2048)  # b's share dropped, not counted
        assert client.stats()[b.address] is None
        assert not client.replicas[1].backoff.available()  # skipped without a network call for now

        cachestore_process(*disk_only, "--disk-dir", str(tmp_path / "b"), port=b.port)  # same port and disk
        assert until(lambda: client.lookup(keys) == 64, timeout=20, fail=False), "restarted replica was not used again"
        assert client.get(keys) == blocks  # from b's disk tier, across the restart
    finally:
        client.close()


def test_slow_replica_costs_a_miss_within_the_deadline():
    with socket.socket() as silent:  # accepts TCP connections, never speaks HTTP/2
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        with CacheStoreClient([address], LAYOUT, timeout_s=0.3, backoff_s=30) as client:
            start = time.monotonic()
            assert client.lookup(chain(4)) == 0
            waited = time.monotonic() - start
            assert 0.3 <= waited < 5, waited  # it waited for the deadline, then gave up (5 s: a stall bound)
            assert not client.replicas[0].backoff.available()
            assert client.get(chain(4)) == [] and client.put(kv_blocks(2)) == 0


def test_put_from_a_background_thread_while_reading(make_server):
    _, address = make_server()
    blocks = kv_blocks(200, 1024)
    with CacheStoreClient([address], LAYOUT) as client:
        writer = threading.Thread(target=lambda: [client.put(blocks[i : i + 10]) for i in range(0, 200, 10)])
        writer.start()
        while writer.is_alive():
            n = client.lookup([blk.key for blk in blocks])
            assert client.get([blk.key for blk in blocks[:n]]) == blocks[:n]
        writer.join()
        assert client.lookup([blk.key for blk in blocks]) == 200


def test_large_puts_are_split_into_messages_and_calls(make_server):
    _, address = make_server(max_message_bytes=1024**2, max_blocks_per_call=16)
    blocks = kv_blocks(40, 200 * 1024)  # 8 MB in 40 blocks: > 1 message and > 1 call
    with CacheStoreClient([address], LAYOUT, max_message_bytes=1024**2, max_blocks_per_call=16) as client:
        assert client.put(blocks) == 40
        assert client.lookup([b.key for b in blocks]) == 40
        assert client.get([b.key for b in blocks]) == blocks
        assert client.delete([b.key for b in blocks]) == 40 and client.lookup([b.key for b in blocks]) == 0
