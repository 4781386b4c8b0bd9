"""A real `ragserve engine` with --kv-events-config and no --router looks like a vLLM pod: its ZMQ stream carries
vLLM's BlockStored/BlockRemoved for the blocks it caches and evicts, a late subscriber replays what it missed,
and a bad config stops the start with a message."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import httpx
import pytest
import zmq

from ragserve.vllm_events import BlockRemoved, BlockStored, Received, ZmqEventSubscriber
from tests.helpers.engine_server import MODEL_NAME, metric, scrape, start_engine
from tests.helpers.net import free_ports
from tests.helpers.process import until_async
from tests.helpers.registration import serve_recorder

pytestmark = pytest.mark.timeout(300)
BS = 16  # the engine's default block size
PROMPT = [1000 + i for i in range(50)]  # 3 full blocks and 2 tokens
SALTED = [3000 + i for i in range(40)]
FILLERS = [[5000 + 300 * k + i for i in range(240)] for k in range(6)]  # 90 blocks: more than the pool's 64


async def complete(client: httpx.AsyncClient, prompt: list[int], **extra) -> dict:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}
    resp = await client.post("/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]


class Events:
    """What one subscriber has received, in order; waits poll the socket, and replay if the stream is quiet
    (a PUB message sent before the subscription reached the publisher is lost, as on any ZMQ PUB socket)."""

    def __init__(self, sub: ZmqEventSubscriber) -> None:
        self.sub = sub
        self.received: list[Received] = []

    @property
    def events(self) -> list:
        return [ev for r in self.received for ev in r.batch.events]

    async def until(self, done: Callable[[list], bool], timeout: float = 30) -> list:
        async def check() -> bool:
            items = await self.sub.recv() if await self.sub.socket.poll(200) else await self.sub.catch_up()
            assert all(isinstance(item, Received) for item in items), items  # never Cold
            self.received += items
            return done(self.events)

        await until_async(check, timeout=timeout, interval=0)
        return self.events


def stored_with(tokens: list[int]) -> Callable[[list], bool]:
    return lambda events: any(isinstance(ev, BlockStored) and ev.token_ids == tokens for ev in events)


@pytest.mark.asyncio
async def test_engine_publishes_vllm_kv_events(tmp_path):
    pub_port, replay_port = free_ports(2)
    pub, replay = f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}"
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub, "replay_endpoint": replay}
    args = ["--kv-events-config", json.dumps(config), "--kv-events-bind", "--num-gpu-blocks", "64"]
    engine = start_engine(tmp_path, *args, "--max-model-len", "256")
    early = late = None
    try:
        engine.wait_ready()
        early = Events(ZmqEventSubscriber(pub, replay))
        async with httpx.AsyncClient(base_url=engine.url) as client:
            assert (await complete(client, PROMPT))["prompt_tokens_details"]["cached_tokens"] == 0
            events = await early.until(stored_with(PROMPT[:48]))
            (stored,) = [ev for ev in events if isinstance(ev, BlockStored) and ev.token_ids == PROMPT[:48]]
            assert len(stored.block_hashes) == 3 and stored.parent_block_hash is None and stored.block_size == BS
            assert all(isinstance(h, bytes) and len(h) == 32 for h in stored.block_hashes)
            assert (stored.medium, stored.lora_id, stored.lora_name, stored.extra_keys) == (
                "GPU",
                None,
                None,
                [None] * 3,
            )
            assert (stored.group_idx, stored.kv_cache_spec_kind) == (0, "full_attention")
            # the tokens the engine says it had cached are the stored blocks' tokens
            again = await complete(client, PROMPT)
            assert again["prompt_tokens_details"]["cached_tokens"] == len(stored.token_ids)

            # a subscriber that connects after the request recovers the batch by replay
            late = Events(ZmqEventSubscriber(pub, replay))
            replayed = await late.until(stored_with(PROMPT[:48]))
            assert late.received[0].replayed and late.received[0].seq == early.received[0].seq
            assert replayed[0] == early.events[0]

            await complete(client, SALTED, cache_salt="tenant-x")
            salted = (await early.until(stored_with(SALTED[:32])))[-1]
            assert salted.extra_keys == [("tenant-x",), None]

            for prompt in FILLERS:  # a 64-block pool: the first prompt's blocks are evicted
                await complete(client, prompt)
            gone = set(stored.block_hashes)

            def removed(evs: list) -> set:
                return {h for ev in evs if isinstance(ev, BlockRemoved) for h in ev.block_hashes}

            await early.until(lambda evs: gone <= removed(evs))
            assert all(ev.medium == "GPU" for ev in early.events if isinstance(ev, BlockRemoved))
            assert (await complete(client, PROMPT))["prompt_tokens_details"]["cached_tokens"] == 0
            await early.until(lambda evs: sum(stored_with(PROMPT[:48])([ev]) for ev in evs) == 2)  # stored again

        samples = scrape(engine.url)
        assert metric(samples, "ragserve:kv_event_batches_published_total") == early.received[-1].seq + 1
        counts = {
            t: metric(samples, "ragserve:kv_events_published_total", type=t) for t in ("BlockStored", "BlockRemoved")
        }
        assert counts["BlockStored"] == sum(isinstance(ev, BlockStored) for ev in early.events)
        assert counts["BlockRemoved"] == sum(isinstance(ev, BlockRemoved) for ev in early.events)
    finally:
        for events in (early, late):
            if events is not None:
                events.sub.close()
        assert engine.stop() == 0, engine.output()[-3000:]  # SIGTERM drains, then the publisher closes
    assert f"vLLM KV events: PUB bound {pub}, replay {replay}" in engine.output()


@pytest.mark.asyncio
async def test_the_router_stream_and_the_vllm_stream_carry_the_same_blocks(tmp_path):
    pub_port, grpc_port = free_ports(2)
    pub = f"tcp://127.0.0.1:{pub_port}"
    registry, recorder = serve_recorder(grpc_port)
    config = json.dumps({"enable_kv_cache_events": True, "endpoint": pub})  # no replay endpoint: PUB only
    args = ["--kv-events-config", config, "--kv-events-bind", "--router", f"127.0.0.1:{grpc_port}"]
    engine = start_engine(tmp_path, *args, "--engine-id", "e-both", "--num-gpu-blocks", "64")
    sub = None
    try:
        engine.wait_ready()
        await until_async(lambda: "e-both" in recorder.known, timeout=60)
        sub = Events(ZmqEventSubscriber(pub, start_seq=None))
        await asyncio.sleep(0.5)  # no replay here: let the subscription reach the publisher first
        async with httpx.AsyncClient(base_url=engine.url) as client:
            await complete(client, PROMPT)
        stored = next(ev for ev in await sub.until(stored_with(PROMPT[:48])) if isinstance(ev, BlockStored))
        await until_async(lambda: recorder.index.get("e-both") == set(stored.block_hashes), timeout=30)
    finally:
        if sub is not None:
            sub.sub.close()
        assert engine.stop() == 0, engine.output()[-3000:]
        registry.stop(0)


def test_a_taken_port_fails_the_start(tmp_path):
    (port,) = free_ports(1)
    endpoint = f"tcp://127.0.0.1:{port}"
    with zmq.Context.instance().socket(zmq.PUB) as taken:
        taken.bind(endpoint)
        config = json.dumps({"enable_kv_cache_events": True, "endpoint": endpoint})
        engine = start_engine(tmp_path, "--kv-events-config", config, "--kv-events-bind")
        assert engine.popen.wait(120) == 1
    assert "cannot open the KV-event sockets" in engine.output()
