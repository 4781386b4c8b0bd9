"""External vLLM engines' KV events into the router's exact index: a real publisher on loopback sockets,
the router's own prompt hashing, and the real router states (in memory and in a redis-server)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable

import msgspec
import pytest
import pytest_asyncio
import zmq

from ragserve.keys import block_hashes, root_hash
from ragserve.router_args import RouterConfig
from ragserve.vllm_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Received,
    ZmqEventPublisher,
    ZmqEventSubscriber,
)
from ragserve.vllm_events.wire import KVEventBatch, decode_batch
from ragserve_router.engines import EngineRecord, ModelSpec
from ragserve_router.external import ExternalEngineSpec, RankFollower, apply_ops, followers
from ragserve_router.memory_state import MemoryState
from ragserve_router.policies import Decider, RouteRequest
from ragserve_router.prompt import prompt_tokens, token_key
from ragserve_router.redis_state import RedisState
from ragserve_router.state import CLEARED, REMOVED, STORED, KVOp, RouterState, leading
from ragserve_router.vllm_index import BlockSizeMismatch, VllmIndexer
from tests.helpers.net import free_ports
from tests.interop import vllm_reference as ref

pytestmark = pytest.mark.timeout(60)
BLOCK = 16
MODEL = "tiny-llama@1"
ENGINE = "vllm-0"


@pytest.fixture(scope="module")
def redis_url(module_cluster):
    return module_cluster.redis()


@pytest_asyncio.fixture(params=["memory", "redis"])
async def state(request) -> AsyncIterator[RouterState]:
    if request.param == "memory":
        yield MemoryState()
        return
    s = RedisState(request.getfixturevalue("redis_url"), f"ext-{uuid.uuid4().hex[:8]}:")
    yield s
    await s.close()


class Prompts:
    """Chats tokenized and hashed by the router's own prompt path."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        self.spec = ModelSpec(MODEL, BLOCK, tokenizer.fingerprint())

    def body(self, topic: str) -> dict:
        return {"messages": [{"role": "user", "content": f"Tell me about {topic}. " + "More words here. " * 20}]}

    def hashes(self, topic: str, salt: str | None = None) -> list[bytes]:
        key = token_key(self.tok, self.spec, self.body(topic), True, salt)
        assert key is not None and key.exact and len(key.hashes) >= 4
        return key.hashes

    def tokens(self, topic: str) -> list[int]:
        tokens = prompt_tokens(self.tok, self.body(topic), True)  # an array("I"): the router's own form
        assert tokens is not None
        return list(tokens)


@pytest.fixture(scope="module")
def prompts(prompt_tokenizer) -> Prompts:
    return Prompts(prompt_tokenizer)


def stored(
    tokens: list[int],
    hashes: list[int],
    parent: int | None = None,
    start: int = 0,
    medium: str = "GPU",
    lora_name: str | None = None,
    **kw,
) -> BlockStored:
    """vLLM's BlockStored of blocks start.. of a prompt, with made-up engine hashes."""
    ids = tokens[start * BLOCK : (start + len(hashes)) * BLOCK]
    return BlockStored(hashes, parent, ids, BLOCK, None, medium, lora_name, **kw)


def engine_hashes(n: int, base: int) -> list[int]:
    return [base + i for i in range(n)]


class Harness:
    def __init__(self, state: RouterState) -> None:
        self.state = state
        self.pub_port, self.replay_port = free_ports(2)
        self.closers: list[Callable[[], None]] = []
        self.tasks: list[asyncio.Task] = []

    def publisher(self, **kwargs) -> ZmqEventPublisher:
        replay = f"tcp://127.0.0.1:{self.replay_port}"
        pub = ZmqEventPublisher(f"tcp://127.0.0.1:{self.pub_port}", replay, bind=True, **kwargs)
        self.closers.append(pub.close)
        return pub

    async def rebind(self) -> ZmqEventPublisher:
        """A new publisher process on the closed one's ports (libzmq frees a closed listener asynchronously)."""
        for _ in range(50):
            with contextlib.suppress(zmq.ZMQError):
                return self.publisher()
            await asyncio.sleep(0.05)
        raise AssertionError("the closed publisher's ports never came free")

    def follower(self, block_size: int = BLOCK) -> RankFollower:
        sub = ZmqEventSubscriber(f"tcp://127.0.0.1:{self.pub_port}", f"tcp://127.0.0.1:{self.replay_port}")
        return RankFollower(VllmIndexer(ENGINE, MODEL, block_size), sub, self.state)

    async def start(self, follower: RankFollower) -> RankFollower:
        self.tasks.append(asyncio.create_task(follower.run()))
        await asyncio.wait_for(follower.ready.wait(), 10)
        return follower

    async def match(self, hashes: list[bytes], engine: str = ENGINE) -> int:
        return (await self.state.match_exact([engine], hashes))[engine]

    async def until_match(self, hashes: list[bytes], expected: int, engine: str = ENGINE) -> None:
        deadline = time.monotonic() + 10
        while (got := await self.match(hashes, engine)) != expected:
            assert time.monotonic() < deadline, f"match_exact stayed {got}, expected {expected}"
            await asyncio.sleep(0.02)


@pytest_asyncio.fixture
async def harness(state) -> AsyncIterator[Harness]:
    h = Harness(state)
    yield h
    for task in h.tasks:
        task.cancel()
    await asyncio.gather(*h.tasks, return_exceptions=True)
    for close in reversed(h.closers):
        close()


@pytest.mark.asyncio
async def test_stored_blocks_match_and_removed_by_engine_hash(harness: Harness, prompts: Prompts) -> None:
    pub = harness.publisher()
    follower = await harness.start(harness.follower())
    hashes, tokens = prompts.hashes("paging"), prompts.tokens("paging")
    n = len(hashes)
    ours = engine_hashes(n, 1000)
    # Two events, the second chained on the first's last block through the engine-hash map.
    pub.publish_events([stored(tokens, ours[:2]), stored(tokens, ours[2:], parent=ours[1], start=2)])
    await harness.until_match(hashes, n)
    pub.publish_events([BlockRemoved([ours[2], 999_999], "GPU")])  # one unknown hash: ignored, counted
    await harness.until_match(hashes, 2)
    assert follower.indexer.stats.unknown_removed == 1
    assert await harness.state.num_blocks(ENGINE) == n - 1


@pytest.mark.asyncio
async def test_cleared_and_restarted_engine_is_forgotten(harness: Harness, prompts: Prompts) -> None:
    pub = harness.publisher()
    follower = await harness.start(harness.follower())
    a, b = prompts.hashes("alpha"), prompts.hashes("beta")
    pub.publish_events([stored(prompts.tokens("alpha"), engine_hashes(len(a), 0))])
    await harness.until_match(a, len(a))
    pub.publish_events([AllBlocksCleared()])
    await harness.until_match(a, 0)
    pub.publish_events([stored(prompts.tokens("alpha"), engine_hashes(len(a), 0))])
    for _ in range(60):  # sequence numbers well past where the new publisher is first seen
        pub.publish_events([BlockRemoved([123_456], "GPU")])
    await harness.until_match(a, len(a))
    pub.close()
    pub = await harness.rebind()
    for _ in range(50):  # a new process from sequence 0: until the subscriber sees it, a batch at a time
        pub.publish_events([stored(prompts.tokens("beta"), engine_hashes(len(b), 500))])
        await asyncio.sleep(0.1)
        if follower.colds:
            break
    assert follower.colds == 1
    await harness.until_match(b, len(b))
    shared = leading(x == y for x, y in zip(a, b, strict=False))  # the chat template's system prompt
    assert await harness.match(a) == shared < len(a)


@pytest.mark.asyncio
async def test_gap_is_replayed(harness: Harness, prompts: Prompts) -> None:
    pub = harness.publisher()
    follower = harness.follower()  # driven frame by frame: one frame is dropped on purpose
    harness.closers.append(follower.subscriber.close)
    hashes, tokens = prompts.hashes("gaps"), prompts.tokens("gaps")
    ours = engine_hashes(3, 70)
    sub = follower.subscriber
    while not await sub.socket.poll(100):  # until the subscription reaches the publisher
        pub.publish_events([BlockRemoved([1], "GPU")])
    frames = [await sub.socket.recv_multipart()]
    for i in range(3):
        pub.publish_events([stored(tokens, ours[i : i + 1], parent=ours[i - 1] if i else None, start=i)])
    frames += [await asyncio.wait_for(sub.socket.recv_multipart(), 5) for _ in range(3)]
    for frame in frames[:2] + frames[3:]:  # the second block's batch never arrives live
        for item in await sub.handle_frames(frame):
            await follower.handle(item)
    assert await harness.match(hashes) == 3
    assert follower.colds == 0


@pytest.mark.asyncio
async def test_wrong_block_size_is_refused(harness: Harness, prompts: Prompts) -> None:
    pub = harness.publisher()
    follower = await harness.start(harness.follower())
    tokens = prompts.tokens("sizes")
    pub.publish_events([BlockStored([1, 2], None, tokens[:64], 32, None, "GPU", None)])
    await asyncio.wait_for(harness.tasks[0], 10)
    assert follower.refused is not None
    assert "publishes blocks of 32 tokens but the pool hashes 16-token blocks" in follower.refused
    assert "--block-size 16" in follower.refused


@pytest.mark.asyncio
async def test_salted_blocks_do_not_match_the_unsalted_prompt(harness: Harness, prompts: Prompts) -> None:
    pub = harness.publisher()
    await harness.start(harness.follower())
    salted, plain = prompts.hashes("salt", salt="tenant-a"), prompts.hashes("salt")
    extra = [("tenant-a",)] + [None] * (len(salted) - 1)  # vLLM: the salt is block 0's extra key
    pub.publish_events([stored(prompts.tokens("salt"), engine_hashes(len(salted), 40), extra_keys=extra)])
    await harness.until_match(salted, len(salted))
    assert await harness.match(plain) == 0
    assert await harness.match(prompts.hashes("salt", salt="tenant-b")) == 0


@pytest.mark.asyncio
async def test_lora_blocks_are_keyed_apart(harness: Harness, prompts: Prompts) -> None:
    pub = harness.publisher()
    follower = await harness.start(harness.follower())
    hashes, tokens = prompts.hashes("lora"), prompts.tokens("lora")
    extra = [("my-adapter",)] * len(hashes)  # vLLM: the LoRA name is each block's first extra key
    pub.publish_events([stored(tokens, engine_hashes(len(hashes), 90), lora_name="my-adapter", extra_keys=extra)])
    pub.publish_events([stored(tokens, engine_hashes(1, 300))])  # then a plain block, so we know both arrived
    await harness.until_match(hashes, 1)
    assert follower.indexer.stats.stored == len(hashes) + 1


@pytest.mark.asyncio
async def test_other_groups_are_ignored(harness: Harness, prompts: Prompts) -> None:
    pub = harness.publisher()
    follower = await harness.start(harness.follower())
    hashes, tokens = prompts.hashes("groups"), prompts.tokens("groups")
    n = len(hashes)
    sliding = dict(group_idx=1, kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=128)
    pub.publish_events([stored(tokens, engine_hashes(n, 10), **sliding)])
    pub.publish_events([stored(tokens, engine_hashes(n, 10), group_idx=0, kv_cache_spec_kind="full_attention")])
    await harness.until_match(hashes, n)
    pub.publish_events([BlockRemoved(engine_hashes(n, 10), "GPU", group_idx=1)])  # the sliding group's eviction
    pub.publish_events([stored(tokens, engine_hashes(1, 600), group_idx=0)])  # a marker: the removal was applied
    deadline = time.monotonic() + 10
    while follower.indexer.stats.stored < n + 1:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    assert follower.indexer.stats.other_group == 2
    assert await harness.match(hashes) == n


@pytest.mark.asyncio
async def test_offloaded_blocks_are_tracked_apart(harness: Harness, prompts: Prompts) -> None:
    pub = harness.publisher()
    await harness.start(harness.follower())
    hashes, tokens = prompts.hashes("offload"), prompts.tokens("offload")
    ours = engine_hashes(len(hashes), 20)
    pub.publish_events([stored(tokens, ours), stored(tokens, ours, medium="CPU")])
    await harness.until_match(hashes, len(hashes), engine=f"{ENGINE}@CPU")
    await harness.until_match(hashes, len(hashes))
    pub.publish_events([BlockRemoved(ours, "GPU")])  # evicted from the GPU, still offloaded
    await harness.until_match(hashes, 0)
    assert await harness.match(hashes, f"{ENGINE}@CPU") == len(hashes)


@pytest.mark.asyncio
async def test_data_parallel_ranks_are_followed_on_port_plus_rank(state: RouterState, prompts: Prompts) -> None:
    base = free_ports(1)[0] - 1  # rank 1 binds base + 1, a port known to be free
    spec = ExternalEngineSpec.parse(f"http://127.0.0.1:1,events=tcp://127.0.0.1:{base},dp=2")
    assert [e for _, e, _ in spec.endpoints()] == [f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + 1}"]
    pub = ZmqEventPublisher(f"tcp://127.0.0.1:{base}", bind=True, data_parallel_rank=1)
    ranks = followers(spec, ENGINE, MODEL, BLOCK, state)
    tasks = [asyncio.create_task(f.run()) for f in ranks]
    try:
        hashes, tokens = prompts.hashes("ranks"), prompts.tokens("ranks")
        deadline = time.monotonic() + 10
        while (await state.match_exact(spec.index_ids(ENGINE), hashes))[f"{ENGINE}/dp1"] != len(hashes):
            assert time.monotonic() < deadline
            pub.publish_events([stored(tokens, engine_hashes(len(hashes), 0))])  # no replay: until one lands
            await asyncio.sleep(0.05)
        assert (await state.match_exact([f"{ENGINE}/dp0"], hashes))[f"{ENGINE}/dp0"] == 0
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        pub.close()


def test_indexer_refuses_a_different_block_size() -> None:
    indexer = VllmIndexer(ENGINE, MODEL, BLOCK)
    with pytest.raises(BlockSizeMismatch, match="publishes blocks of 8 tokens but the pool hashes 16-token"):
        indexer.events([BlockStored([1], None, list(range(8)), 8, None, "GPU", None)])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("events=tcp://127.0.0.1:5557", "must start with the engine's http"),
        ("http://h:8000", "events=tcp://HOST:PORT is required"),
        ("http://h:8000,events=127.0.0.1:5557", "must be tcp://HOST:PORT"),
        ("http://h:8000,events=tcp://h:5557,replay=tcp://h", "replay='tcp://h' must be tcp://HOST:PORT"),
        ("http://h:8000,events=tcp://h:5557,dp=0", "dp must be a positive integer"),
        ("http://h:8000,events=tcp://h:5557,topic=x", "unknown option 'topic'"),
        ("http://h:8000,events=tcp://h:5557,events=tcp://h:1", "events given twice"),
        ("http://h:8000,events", "is not NAME=VALUE"),
    ],
)
def test_spec_parse_errors(text: str, message: str) -> None:
    with pytest.raises(ValueError, match="--external-engine") as info:
        ExternalEngineSpec.parse(text)
    assert message in str(info.value)


def test_spec_parse() -> None:
    spec = ExternalEngineSpec.parse("http://vllm:8000/,events=tcp://vllm:5557,replay=tcp://vllm:5558,dp=2")
    assert spec == ExternalEngineSpec("http://vllm:8000", "tcp://vllm:5557", "tcp://vllm:5558", 2)
    assert spec.value() == "http://vllm:8000,events=tcp://vllm:5557,replay=tcp://vllm:5558,dp=2"
    plain = ExternalEngineSpec("http://vllm:8000", "tcp://vllm:5557")
    assert ExternalEngineSpec.parse(plain.value()) == plain
    assert spec.endpoints()[1] == (1, "tcp://vllm:5558", "tcp://vllm:5559")
    assert spec.index_ids("e") == ["e/dp0", "e/dp1"]


def test_older_vllm_lora_int_id_keys_blocks_apart(prompts: Prompts) -> None:
    tokens = prompts.tokens("int-lora")
    plain = VllmIndexer(ENGINE, MODEL, BLOCK).events([stored(tokens, [1])])
    event = BlockStored([1], None, tokens[:BLOCK], BLOCK, 7, "GPU", None, extra_keys=[(7,)])
    lora = VllmIndexer(ENGINE, MODEL, BLOCK).events([event])
    assert plain[ENGINE][0].hashes == prompts.hashes("int-lora")[:1]
    assert lora[ENGINE][0].hashes != plain[ENGINE][0].hashes


@pytest.mark.asyncio
async def test_kv_aware_routes_to_the_engine_whose_events_hold_the_prompt(prompts: Prompts) -> None:
    """The real policy over the real state: an engine indexed from vLLM events is a prefix hit, like a
    registered one (the record stands in for the pool's, which does not list external engines yet)."""
    state = MemoryState()
    records = [
        EngineRecord(e, f"http://127.0.0.1:1/{e}", ["m"], model_id=MODEL, block_size=BLOCK) for e in ("e0", ENGINE)
    ]
    decider = Decider(RouterConfig(), state, lambda r: 0.0, lambda r: 0.0)
    tokens, body = prompts.tokens("route"), prompts.body("route")
    indexer = VllmIndexer(ENGINE, MODEL, BLOCK)
    await apply_ops(state, indexer.events([stored(tokens, engine_hashes(len(tokens) // BLOCK, 0))]), 1)
    key = token_key(prompts.tok, prompts.spec, body, True, None)
    assert key is not None
    decision = await decider.decide("kv_aware", RouteRequest("m", body, True, {}, key), records)
    assert decision.order[0].engine_id == ENGINE and decision.reason == "prefix_hit"
    await apply_ops(state, indexer.events([AllBlocksCleared()]), 2)
    decision = await decider.decide("kv_aware", RouteRequest("m", body, True, {}, key), records)
    assert decision.reason != "prefix_hit"


@pytest.mark.asyncio
async def test_offloaded_blocks_cost_between_a_gpu_hit_and_a_recompute(prompts: Prompts) -> None:
    """Blocks an engine's events put on CPU or disk are priced as a load (CPU cheaper than disk): the GPU
    holder first, then CPU, then disk, then the engine holding nothing, by predicted TTFT too."""
    state = MemoryState()
    tokens, body = prompts.tokens("offload"), prompts.body("offload")
    media = {"gpu": "GPU", "cpu": "CPU", "disk": "DISK"}
    indexers = {e: VllmIndexer(e, MODEL, BLOCK) for e in (*media, "cold")}
    for e, medium in media.items():
        event = stored(tokens, engine_hashes(len(tokens) // BLOCK, 0), medium=medium)
        await apply_ops(state, indexers[e].events([event]), 1)
    records = [EngineRecord(e, f"http://127.0.0.1:1/{e}", ["m"], model_id=MODEL, block_size=BLOCK) for e in indexers]
    decider = Decider(
        RouterConfig(),
        state,
        lambda r: 0.0,
        lambda r: 0.0,
        offload_tiers=lambda r: indexers[r.engine_id].offload_tiers(),
    )
    key = token_key(prompts.tok, prompts.spec, body, True, None)
    assert key is not None
    decision = await decider.decide("kv_aware", RouteRequest("m", body, True, {}, key), records)
    assert [r.engine_id for r in decision.order] == ["gpu", "cpu", "disk", "cold"]
    p = decision.predictions
    held = len(tokens) // BLOCK * BLOCK
    assert p["gpu"].local_tokens == held and p["gpu"].fetched_tokens == 0
    assert p["cpu"].fetched_tokens == p["disk"].fetched_tokens == held and p["cpu"].local_tokens == 0
    assert p["cold"].computed_tokens == len(tokens)
    assert p["gpu"].ttft_s < p["cpu"].ttft_s < p["disk"].ttft_s < p["cold"].ttft_s
    assert decision.predicted_cached_tokens("cpu", key) == held
    await apply_ops(state, indexers["cpu"].events([BlockRemoved(engine_hashes(len(tokens) // BLOCK, 0), "CPU")]), 2)
    decision = await decider.decide("kv_aware", RouteRequest("m", body, True, {}, key), records)
    assert decision.predictions["cpu"].fetched_tokens == 0


class FlakyState(MemoryState):
    """A state whose apply fails while `down` (Redis unreachable)."""

    down = False

    async def apply(self, engine_id: str, ops: list, new_seq: int) -> None:
        if self.down:
            raise ConnectionError("state unreachable")
        await super().apply(engine_id, ops, new_seq)


@pytest.mark.asyncio
async def test_ops_lost_to_an_unreachable_state_clear_the_engine(prompts: Prompts) -> None:
    state = FlakyState()
    sub = ZmqEventSubscriber(f"tcp://127.0.0.1:{free_ports(1)[0]}")
    follower = RankFollower(VllmIndexer(ENGINE, MODEL, BLOCK), sub, state)
    try:
        a, b = prompts.hashes("flaky-a"), prompts.hashes("flaky-b")
        ours = engine_hashes(len(a), 0)
        await follower.handle(Received(0, KVEventBatch(0.0, [stored(prompts.tokens("flaky-a"), ours)])))
        assert (await state.match_exact([ENGINE], a))[ENGINE] == len(a)
        state.down = True
        await follower.handle(Received(1, KVEventBatch(0.0, [BlockRemoved(ours, "GPU")])))  # lost
        assert follower.stale
        state.down = False
        await follower.handle(
            Received(2, KVEventBatch(0.0, [stored(prompts.tokens("flaky-b"), engine_hashes(len(b), 50))]))
        )
        assert not follower.stale
        assert (await state.match_exact([ENGINE], b))[ENGINE] == len(b)
        shared = leading(x == y for x, y in zip(a, b, strict=False))
        assert (await state.match_exact([ENGINE], a))[ENGINE] == shared < len(a)  # not the evicted blocks
    finally:
        sub.close()


def test_vllm_encoded_batches_decode_to_the_expected_index_ops() -> None:
    """Golden bytes: each event type as vLLM's own structs encode it (bytes hashes, vLLM's default), decoded by
    the router, becomes the ops ragserve's key scheme predicts."""
    tokens = list(range(100, 100 + 3 * BLOCK))
    keys = block_hashes(tokens, BLOCK, root_hash(MODEL), cache_salt="s")
    ours = [bytes([i]) * 32 for i in range(3)]
    events = [
        ref.BlockStored(
            ours[:2], None, tokens[: 2 * BLOCK], BLOCK, None, "GPU", None, [("s",), None], 0, "full_attention"
        ),
        ref.BlockStored(ours[2:], ours[1], tokens[2 * BLOCK :], BLOCK, None, None, None),
        ref.BlockRemoved([ours[0]], "GPU"),
        ref.AllBlocksCleared(),
    ]
    payload = msgspec.msgpack.encode(ref.EventBatch(ts=1.0, events=events, data_parallel_rank=0))
    ops = VllmIndexer(ENGINE, MODEL, BLOCK).events(decode_batch(payload).events)
    assert ops == {ENGINE: [KVOp(STORED, keys[:2]), KVOp(STORED, keys[2:]), KVOp(REMOVED, keys[:1]), KVOp(CLEARED, [])]}
