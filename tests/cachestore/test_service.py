"""The CacheStore gRPC service in-process on a free port, through raw stubs: round trips, namespacing, errors."""

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from ragserve.v1 import cachestore_pb2 as pb
from ragserve.v1 import cachestore_pb2_grpc as pb_grpc
from ragserve_cachestore.record import checksum
from tests.helpers.cachestore import LAYOUT, OTHER_LAYOUT, chain, kv_blocks, pb_blocks
from tests.helpers.net import free_port


@pytest.fixture
def stub(make_server):
    _, address = make_server(memory=64 * 1024**2)
    with grpc.insecure_channel(address) as channel:
        yield pb_grpc.CacheStoreStub(channel)


def put(stub, blocks, layout=LAYOUT, per_message=50) -> pb.PutResponse:
    messages = [
        pb.PutRequest(layout=layout, blocks=blocks[i : i + per_message]) for i in range(0, len(blocks), per_message)
    ]
    return stub.Put(iter(messages))


def status_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def test_put_lookup_get_round_trip_of_many_blocks(stub):
    blocks = pb_blocks(kv_blocks(300, 4096))
    assert put(stub, blocks).stored == 300
    keys = [b.key for b in blocks]
    reply = stub.Lookup(pb.LookupRequest(layout=LAYOUT, keys=keys))
    assert reply.prefix_len == 300 and set(reply.tiers) == {pb.TIER_MEMORY}
    got = list(stub.Get(pb.GetRequest(layout=LAYOUT, keys=keys)))
    assert got == blocks
    again = put(stub, blocks[:10])
    assert (again.stored, again.skipped) == (0, 10)


def test_lookup_and_get_stop_at_the_first_missing_block(stub):
    blocks = pb_blocks(kv_blocks(6))
    put(stub, blocks[:3] + blocks[4:])
    keys = [b.key for b in blocks]
    assert stub.Lookup(pb.LookupRequest(layout=LAYOUT, keys=keys)).prefix_len == 3
    assert [b.key for b in stub.Get(pb.GetRequest(layout=LAYOUT, keys=keys))] == keys[:3]
    assert stub.Lookup(pb.LookupRequest(layout=LAYOUT, keys=keys[3:])).prefix_len == 0


def test_blocks_of_another_layout_are_never_served(stub):
    blocks = pb_blocks(kv_blocks(4))
    put(stub, blocks)
    keys = [b.key for b in blocks]
    assert stub.Lookup(pb.LookupRequest(layout=OTHER_LAYOUT, keys=keys)).prefix_len == 0
    assert list(stub.Get(pb.GetRequest(layout=OTHER_LAYOUT, keys=keys))) == []
    assert stub.Delete(pb.DeleteRequest(layout=OTHER_LAYOUT, keys=keys)).deleted == 0
    assert stub.Lookup(pb.LookupRequest(layout=LAYOUT, keys=keys)).prefix_len == 4


def test_delete_and_stats(stub):
    blocks = pb_blocks(kv_blocks(5, 2048))
    put(stub, blocks)
    assert stub.Delete(pb.DeleteRequest(layout=LAYOUT, keys=[b.key for b in blocks[3:]])).deleted == 2
    stub.Lookup(pb.LookupRequest(layout=LAYOUT, keys=[b.key for b in blocks]))
    stats = stub.Stats(pb.StatsRequest())
    assert (stats.puts, stats.lookups, stats.hits, stats.misses) == (5, 1, 3, 1)
    (memory,) = stats.tiers
    assert memory.tier == pb.TIER_MEMORY and memory.blocks == 3 and memory.capacity_bytes == 64 * 1024**2


@pytest.mark.parametrize(
    ("call", "code", "message"),
    [
        (lambda s: s.Lookup(pb.LookupRequest(layout="nope", keys=chain(1))), "INVALID_ARGUMENT", "32 hex chars"),
        (lambda s: s.Lookup(pb.LookupRequest(layout=LAYOUT, keys=[b"short"])), "INVALID_ARGUMENT", "key 0: block key"),
        (lambda s: list(s.Get(pb.GetRequest(layout=LAYOUT, keys=[b"k" * 33]))), "INVALID_ARGUMENT", "32 bytes"),
        (lambda s: s.Delete(pb.DeleteRequest(layout="", keys=chain(1))), "INVALID_ARGUMENT", "layout must be"),
        (lambda s: s.Lookup(pb.LookupRequest(layout=LAYOUT, keys=chain(9000))), "RESOURCE_EXHAUSTED", "limit of 8192"),
    ],
    ids=["bad-layout", "short-key", "long-key", "empty-layout", "too-many-keys"],
)
def test_invalid_requests_get_a_clear_status(stub, call, code, message):
    got_code, details = status_of(lambda: call(stub))
    assert got_code == getattr(grpc.StatusCode, code) and message in details


def test_put_checks_every_block_and_its_checksum(stub):
    good = pb_blocks(kv_blocks(3))
    bad_crc = pb_blocks(kv_blocks(1, seed="x"))[0]
    bad_crc.checksum ^= 1
    code, details = status_of(lambda: put(stub, [*good, bad_crc]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "block 3: checksum does not match" in details
    assert stub.Lookup(pb.LookupRequest(layout=LAYOUT, keys=[b.key for b in good])).prefix_len == 0  # none stored

    wrong_shape = pb.Block(key=chain(1)[0], data=b"\0" * 10, dtype="float16", shape=[4], checksum=checksum(b"\0" * 10))
    code, details = status_of(lambda: put(stub, [wrong_shape]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "needs 8" in details
    code, details = status_of(lambda: put(stub, good, layout="G" * 32))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "32 hex chars" in details


def test_limits_on_blocks_per_call_and_message_size(make_server):
    _, address = make_server(max_blocks_per_call=10, max_message_bytes=1024**2)
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 8 * 1024**2)]) as channel:
        stub = pb_grpc.CacheStoreStub(channel)
        code, details = status_of(lambda: put(stub, pb_blocks(kv_blocks(11)), per_message=5))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "11 blocks in one call exceeds the limit of 10" in details
        big = pb_blocks(kv_blocks(1, 2 * 1024**2))
        code, details = status_of(lambda: put(stub, big))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details
        # messages before the one that crossed the limit were valid and stay stored
        assert stub.Lookup(pb.LookupRequest(layout=LAYOUT, keys=chain(10))).prefix_len == 10
        assert stub.Lookup(pb.LookupRequest(layout=LAYOUT, keys=chain(11)[10:])).prefix_len == 0
        assert put(stub, pb_blocks(kv_blocks(10, seed="more"))).stored == 10


def test_health_reports_serving_and_reflection_lists_services(make_server):
    _, address = make_server()
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "ragserve.v1.CacheStore"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        (reply,) = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for s in reply.list_services_response.service}
        assert {"ragserve.v1.CacheStore", "grpc.health.v1.Health"} <= names


def test_prometheus_metrics(make_server, tmp_path):
    metrics_port = free_port()
    _, address = make_server(memory=2400, disk_dir=str(tmp_path), disk=10**6, metrics_port=metrics_port)
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.CacheStoreStub(channel)
        blocks = pb_blocks(kv_blocks(5, 1024))
        put(stub, blocks)
        list(stub.Get(pb.GetRequest(layout=LAYOUT, keys=[blocks[0].key, chain(1, "missing")[0]])))
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
    for line in (
        'ragserve_cachestore_hits_total{tier="disk"} 1.0',
        'ragserve_cachestore_misses_total{tier="memory"} 2.0',
        'ragserve_cachestore_evictions_total{tier="memory"} 4.0',
        'ragserve_cachestore_capacity_bytes{tier="memory"} 2400.0',
        'ragserve_cachestore_blocks{tier="disk"} 4.0',
        "ragserve_cachestore_puts_total 5.0",
        'ragserve_cachestore_corrupt_total{tier="disk"} 0.0',
    ):
        assert line in text, line
