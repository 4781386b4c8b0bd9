"""The engine's pool events as vLLM's KV events: the bytes vLLM's own structs encode for the same blocks."""

from __future__ import annotations

import msgspec
import pytest

from ragserve.engine_args import ServerConfig
from ragserve.keys import block_hashes, root_hash
from ragserve.vllm_events import KVEventsConfig, encode_batch
from ragserve.vllm_events import wire as ours
from ragserve_engine.block_pool import BlockPool, KVEvent
from ragserve_engine.kv_cache_manager import KVCacheManager
from ragserve_engine.server.vllm_kv_events import PublishStats, VllmKVEventPublisher, to_vllm_events
from tests.helpers.kv_pool import BS, LAYOUT, admit
from tests.helpers.net import free_ports
from tests.interop import vllm_reference as ref

ROOT = root_hash("unit-test-model")
TS = 1764700000.5


def manager(num_blocks: int = 8) -> KVCacheManager:
    kv = KVCacheManager(BlockPool(num_blocks), LAYOUT)
    kv.pool.record_events = True
    return kv


def stored(hashes, parent, tokens, extra) -> ref.BlockStored:
    """What vLLM's BlockPool.cache_full_blocks emits, with kv_cache_manager's spec annotation."""
    return ref.BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=BS,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=extra,
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )


def payload(kv: KVCacheManager) -> bytes:
    return encode_batch(ours.EventBatch(TS, to_vllm_events(kv.pool.take_events(), BS), 0))


def reference(*events) -> bytes:
    return msgspec.msgpack.encode(ref.EventBatch(TS, list(events), 0))


def test_a_prompt_is_one_block_stored_of_its_full_blocks():
    kv = manager()
    tokens = list(range(100, 111))  # 2 full blocks + 3 tokens
    admit(kv, tokens, salt="tenant-a")
    h = block_hashes(tokens, BS, ROOT, "tenant-a")
    assert payload(kv) == reference(stored(h, None, tokens[:8], [("tenant-a",), None]))


def test_an_extension_chains_onto_the_cached_prefix_and_carries_no_salt():
    kv = manager()
    admit(kv, list(range(9)))
    kv.pool.take_events()
    longer = list(range(13))  # the 2 cached blocks hit, 1 more full block
    admit(kv, longer)
    h = block_hashes(longer, BS, ROOT)
    assert payload(kv) == reference(stored([h[2]], h[1], longer[8:12], [None]))


def test_two_requests_in_one_step_are_two_block_stored_in_one_batch():
    kv = manager()
    a, b = list(range(8)), list(range(50, 58))
    admit(kv, a)
    admit(kv, b)
    ha, hb = block_hashes(a, BS, ROOT), block_hashes(b, BS, ROOT)
    assert payload(kv) == reference(stored(ha, None, a, [None, None]), stored(hb, None, b, [None, None]))


def test_eviction_is_one_block_removed_per_block_and_reset_is_all_blocks_cleared():
    kv = manager(num_blocks=4)
    first = list(range(12))
    kv.free(admit(kv, first))  # 3 cached blocks, all free
    kv.pool.take_events()
    taken = kv.pool.get_new_blocks(3)  # 1 never-used block, then first's tail and middle blocks are evicted
    h = block_hashes(first, BS, ROOT)
    removed = [ref.BlockRemoved(block_hashes=[x], medium="GPU", group_idx=0) for x in (h[2], h[1])]
    assert payload(kv) == reference(*removed)
    kv.pool.free_blocks(taken)
    assert kv.pool.reset_prefix_cache()
    assert payload(kv) == reference(ref.AllBlocksCleared())


def test_blend_chunk_keys_are_not_sent():
    chunk = KVEvent("stored", [bytes(32)], chunk=True)
    assert to_vllm_events([chunk, KVEvent("removed", [bytes(32)], chunk=True)], BS) == []


class FakePublisher:
    def __init__(self) -> None:
        self.batches: list[ours.EventBatch] = []

    def publish(self, batch: ours.EventBatch) -> None:
        self.batches.append(batch)


def test_the_listener_publishes_one_batch_per_step_and_counts():
    fake = FakePublisher()
    listener = VllmKVEventPublisher(fake)  # type: ignore[arg-type]
    listener.block_size = BS
    kv = manager()
    admit(kv, list(range(9)))
    listener.on_events(kv.pool.take_events())
    listener.on_events([KVEvent("stored", [bytes(32)], chunk=True)])  # nothing for vLLM: no batch
    listener.on_events([KVEvent("removed", [bytes(32)]), KVEvent("cleared")])
    assert [len(b.events) for b in fake.batches] == [1, 2]
    assert listener.stats == PublishStats(2, {"BlockStored": 1, "BlockRemoved": 1, "AllBlocksCleared": 1})


@pytest.mark.parametrize(
    "text", ['{"enable_kv_cache_events": false}', '{"enable_kv_cache_events": true, "publisher": "null"}', "{}"]
)
def test_events_off_or_the_null_publisher_open_no_socket(text):
    config = ServerConfig(kv_events_config=text).kv_events()
    assert config is not None and VllmKVEventPublisher.start(config) is None
    assert ServerConfig().kv_events() is None


def test_a_concrete_endpoint_connects_as_vllm_does_unless_told_to_bind():
    (port,) = free_ports(1)
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{port}")
    for bind in (False, True):
        listener = VllmKVEventPublisher.start(config, bind=bind)
        assert listener is not None and listener.publisher.bound is bind
        listener.close()
