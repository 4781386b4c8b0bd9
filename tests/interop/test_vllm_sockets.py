"""vLLM-format publisher and subscriber on real loopback sockets: exact frames, order, replay, cold engines."""

import asyncio
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from ragserve.vllm_events import Cold, EventBatch, Received, ZmqEventPublisher, ZmqEventSubscriber
from ragserve.vllm_events.wire import BlockStored
from tests.helpers.net import free_ports
from tests.interop import vllm_reference as ref

pytestmark = pytest.mark.timeout(30)


def _batch(i: int) -> EventBatch:
    return EventBatch(ts=1000.0 + i, events=[BlockStored([i], i - 1 if i else None, [i, i], 2, None, "GPU", None)])


def _ref_payload(i: int, rank: int) -> bytes:
    """Batch i as vLLM's own structs encode it."""
    event = ref.BlockStored([i], i - 1 if i else None, [i, i], 2, None, "GPU", None)
    return msgspec.msgpack.encode(ref.EventBatch(ts=1000.0 + i, events=[event], data_parallel_rank=rank))


class Harness:
    def __init__(self) -> None:
        self.pub_port, self.replay_port = free_ports(2)
        self.closers: list = []

    def publisher(self, replay: bool = True, **kwargs) -> ZmqEventPublisher:
        replay_endpoint = f"tcp://127.0.0.1:{self.replay_port}" if replay else None
        pub = ZmqEventPublisher(f"tcp://127.0.0.1:{self.pub_port}", replay_endpoint, bind=True, **kwargs)
        self.closers.append(pub.close)
        return pub

    def subscriber(self, replay: bool = True, **kwargs) -> ZmqEventSubscriber:
        replay_endpoint = f"tcp://127.0.0.1:{self.replay_port}" if replay else None
        sub = ZmqEventSubscriber(f"tcp://127.0.0.1:{self.pub_port}", replay_endpoint, **kwargs)
        self.closers.append(sub.close)
        return sub


@pytest.fixture
def harness() -> Iterator[Harness]:
    h = Harness()
    yield h
    for close in reversed(h.closers):
        close()


async def _poll(sub: ZmqEventSubscriber, timeout_ms: int = 200) -> list:
    if await sub.socket.poll(timeout_ms):
        return await sub.recv()
    return []


async def _publish_until_seen(pub: ZmqEventPublisher, sub: ZmqEventSubscriber, first: int) -> tuple[list, int]:
    """Publish batches first, first+1, ... one at a time until the subscriber sees one (a SUB socket misses
    what is published before its subscription reaches the publisher); returns the items and the next index."""
    i = first
    while True:
        pub.publish(_batch(i))
        i += 1
        items = await _poll(sub)
        if items:
            return items, i
        assert i < first + 50, "subscriber never received a batch"


async def _receive_through(sub: ZmqEventSubscriber, last_seq: int) -> list:
    items: list = []
    while not items or not isinstance(items[-1], Received) or items[-1].seq < last_seq:
        items += await asyncio.wait_for(sub.recv(), 5)
    return items


async def _rebind(harness: Harness) -> ZmqEventPublisher:
    """A new publisher on the ports of a closed one (libzmq releases a closed listener asynchronously)."""
    for _ in range(50):
        try:
            return harness.publisher()
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE:
                raise
            await asyncio.sleep(0.05)
    raise AssertionError("the closed publisher's ports never came free")


def _seqs(items: list) -> list[int]:
    assert not [item for item in items if isinstance(item, Cold)], items
    return [item.seq for item in items]


def test_frames_and_replay_bytes_match_vllm(harness: Harness) -> None:
    pub = harness.publisher(topic="kv-events", data_parallel_rank=0)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{harness.pub_port}")
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{harness.replay_port}")
    try:
        i = 0
        while not sub.poll(100):
            pub.publish(_batch(i))
            i += 1
            assert i < 50
        frames = sub.recv_multipart()
        seq = int.from_bytes(frames[1], "big")
        assert frames == [b"kv-events", seq.to_bytes(8, "big"), _ref_payload(seq, 0)]
        pub.flush()
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])  # vLLM's request: the start sequence, 8 bytes
        replies = [dealer.recv_multipart() for _ in range(i + 1)]
        expected = [[b"", n.to_bytes(8, "big"), _ref_payload(n, 0)] for n in range(i)]
        assert replies == expected + [[b"", b"\xff" * 8, b""]]  # then vLLM's end marker: seq -1, empty payload
        dealer.send_multipart([b"", (i + 5).to_bytes(8, "big")])  # nothing buffered that far: just the marker
        assert dealer.recv_multipart() == [b"", b"\xff" * 8, b""]
    finally:
        sub.close(linger=0)
        dealer.close(linger=0)


def test_data_parallel_rank_publishes_on_port_plus_rank(harness: Harness) -> None:
    base = harness.pub_port - 1  # rank 1 binds base + 1, a port known to be free
    pub = ZmqEventPublisher(f"tcp://127.0.0.1:{base}", bind=True, data_parallel_rank=1)
    harness.closers.append(pub.close)
    assert pub.endpoint == f"tcp://127.0.0.1:{harness.pub_port}"
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.endpoint)
    try:
        deadline = time.monotonic() + 10
        while not sub.poll(100):
            pub.publish(_batch(0))
            assert time.monotonic() < deadline
        assert sub.recv_multipart()[2] == _ref_payload(0, 1)
    finally:
        sub.close(linger=0)


@pytest.mark.asyncio
async def test_batches_arrive_in_order(harness: Harness) -> None:
    pub, sub = harness.publisher(), harness.subscriber()
    items, i = await _publish_until_seen(pub, sub, 0)
    for n in range(i, 20):
        pub.publish(_batch(n))
    async for item in sub:  # the subscriber as an async iterator
        items.append(item)
        if isinstance(item, Received) and item.seq == 19:
            break
    assert _seqs(items) == list(range(20))
    assert [item.batch.ts for item in items] == [1000.0 + n for n in range(20)]
    assert items[7].batch.events == [BlockStored([7], 6, [7, 7], 2, None, "GPU", None)]


@pytest.mark.asyncio
async def test_late_subscriber_recovers_by_replay(harness: Harness) -> None:
    pub = harness.publisher()
    for n in range(5):
        pub.publish(_batch(n))
    pub.flush()
    sub = harness.subscriber()
    items = await sub.catch_up()
    assert _seqs(items) == [0, 1, 2, 3, 4] and all(item.replayed for item in items)
    more, i = await _publish_until_seen(pub, sub, 5)
    assert _seqs(more) == list(range(5, i)) and not more[-1].replayed
    # Replayed ahead of the live stream: the live copies are recognised and not delivered twice.
    pub.publish(_batch(i))
    pub.publish(_batch(i + 1))
    pub.flush()
    assert _seqs(await sub.catch_up()) == [i, i + 1]
    assert await asyncio.wait_for(sub.recv(), 5) == []
    assert await asyncio.wait_for(sub.recv(), 5) == []
    pub.publish(_batch(i + 2))
    assert _seqs(await asyncio.wait_for(sub.recv(), 5)) == [i + 2]


@pytest.mark.asyncio
async def test_dropped_frames_are_replayed(harness: Harness) -> None:
    pub, sub = harness.publisher(), harness.subscriber()
    _, i = await _publish_until_seen(pub, sub, 0)
    for n in range(i, i + 6):
        pub.publish(_batch(n))
    frames = [await asyncio.wait_for(sub.socket.recv_multipart(), 5) for _ in range(6)]
    assert _seqs(await sub.handle_frames(frames[0])) == [i]
    items = await sub.handle_frames(frames[3])  # frames 1 and 2 dropped on purpose
    assert _seqs(items) == [i + 1, i + 2, i + 3] and [item.replayed for item in items] == [True, True, False]
    assert items[0].batch.ts == 1000.0 + i + 1
    assert _seqs(await sub.handle_frames(frames[5])) == [i + 4, i + 5]


@pytest.mark.asyncio
async def test_gap_older_than_the_replay_buffer_is_cold(harness: Harness) -> None:
    pub, sub = harness.publisher(buffer_steps=3), harness.subscriber()
    _, i = await _publish_until_seen(pub, sub, 0)
    for n in range(i, i + 8):
        pub.publish(_batch(n))
    frames = [await asyncio.wait_for(sub.socket.recv_multipart(), 5) for _ in range(8)]
    items = await sub.handle_frames(frames[-1])  # i .. i+6 missed; the buffer holds only i+5 .. i+7
    assert [type(item) for item in items] == [Cold, Received]
    assert items[0].reason == "gap" and items[1].seq == i + 7


@pytest.mark.asyncio
async def test_gap_without_replay_is_cold(harness: Harness) -> None:
    pub = harness.publisher(replay=False)
    sub = harness.subscriber(start_seq=None, replay_timeout=0.3)  # replay endpoint set, nobody answers
    _, i = await _publish_until_seen(pub, sub, 0)
    pub.publish(_batch(i))
    pub.publish(_batch(i + 1))
    frames = [await asyncio.wait_for(sub.socket.recv_multipart(), 5) for _ in range(2)]
    items = await sub.handle_frames(frames[1])
    assert [type(item) for item in items] == [Cold, Received] and items[0].reason == "gap"
    pub.publish(_batch(i + 2))
    assert _seqs(await asyncio.wait_for(sub.recv(), 5)) == [i + 2]  # back in step after the cold report


@pytest.mark.asyncio
async def test_publisher_restart_is_cold(harness: Harness) -> None:
    first, sub = harness.publisher(), harness.subscriber()
    items, i = await _publish_until_seen(first, sub, 0)
    for n in range(i, 10):
        first.publish(_batch(n))
    items += await _receive_through(sub, 9)
    assert _seqs(items) == list(range(10))
    first.close()
    second = await _rebind(harness)  # same ports, sequence numbers from 0 again
    items, _ = await _publish_until_seen(second, sub, 100)
    assert isinstance(items[0], Cold) and items[0].reason == "restart"
    assert _seqs(items[1:]) == list(range(len(items) - 1))  # the new publisher's batches from 0 (replayed)
    assert items[1].batch.ts == 1100.0
