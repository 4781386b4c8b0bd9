"""vLLM's KV events from a ragserve engine (`--kv-events-config`): each step's pool events, one EventBatch.

As vLLM's BlockPool does: the blocks one request caches in a step (a chain) are one BlockStored with their
tokens, block size, medium "GPU" and per-block extra keys (the cache salt in block 0's); each evicted block is
one BlockRemoved; a prefix-cache reset is AllBlocksCleared. Block hashes are ragserve's own (bytes). Blend
chunk keys are ragserve's alone and are not sent. Published beside the router's gRPC stream, not instead.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ragserve.vllm_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventsConfig,
    ZmqEventPublisher,
)
from ragserve.vllm_events.wire import MEDIUM_GPU
from ragserve_engine.engine_client import KVEvent

if TYPE_CHECKING:
    from ragserve.vllm_events import KVEvent as VllmEvent
    from ragserve_engine.engine_client import EngineClient

log = logging.getLogger("ragserve_engine.server")

GROUP_IDX = 0  # one KV-cache group, full attention (what vLLM sends for a plain decoder)
SPEC_KIND = "full_attention"
FLUSH_S = 5.0  # how long shutdown waits for queued batches to reach the socket


def to_vllm_events(events: list[KVEvent], block_size: int) -> list[VllmEvent]:
    """Pool events, in order, as vLLM's events; consecutive chained stores coalesce into one BlockStored."""
    out: list[VllmEvent] = []
    for ev in events:
        if ev.chunk:
            continue
        if ev.kind == "stored":
            _store(out, ev, block_size)
        elif ev.kind == "removed":
            out += [BlockRemoved([h], MEDIUM_GPU, group_idx=GROUP_IDX) for h in ev.block_hashes]
        elif ev.kind == "cleared":
            out.append(AllBlocksCleared())
    return out


def _store(out: list[VllmEvent], ev: KVEvent, block_size: int) -> None:
    # vLLM's extra keys: per block None, or a tuple of the extra hash inputs (here only block 0's cache salt).
    extra: list[tuple | None] = [None] * len(ev.block_hashes)
    if ev.cache_salt and extra:
        extra[0] = (ev.cache_salt,)
    prev = out[-1] if out else None
    if isinstance(prev, BlockStored) and ev.parent_hash is not None and prev.block_hashes[-1] == ev.parent_hash:
        prev.block_hashes += ev.block_hashes
        prev.token_ids += ev.token_ids
        prev.extra_keys += extra
        return
    stored = BlockStored(
        block_hashes=list(ev.block_hashes),
        parent_block_hash=ev.parent_hash,
        token_ids=list(ev.token_ids),
        block_size=block_size,
        lora_id=None,
        medium=MEDIUM_GPU,
        lora_name=None,
        extra_keys=extra,
        group_idx=GROUP_IDX,
        kv_cache_spec_kind=SPEC_KIND,
    )
    out.append(stored)


@dataclass
class PublishStats:
    batches: int = 0
    events: Counter[str] = field(default_factory=Counter)  # by event type: BlockStored, BlockRemoved, ...


class VllmKVEventPublisher:
    """The engine's KV-event listener publishing vLLM's batches. Bound at start, attached once the model loads."""

    def __init__(self, publisher: ZmqEventPublisher) -> None:
        self.publisher = publisher
        self.block_size = 0
        self.stats = PublishStats()
        self._closed = False

    @classmethod
    def start(cls, config: KVEventsConfig, bind: bool = False) -> VllmKVEventPublisher | None:
        """None when the config publishes nothing (events off or the null publisher). `bind`: bind the PUB
        endpoint even where vLLM's rule connects (a concrete address such as tcp://127.0.0.1:5557)."""
        if not config.publishes:
            return None
        publisher = ZmqEventPublisher.from_config(config, bind=True if bind else None)
        how = "bound" if publisher.bound else "connected"
        log.info("vLLM KV events: PUB %s %s, replay %s", how, publisher.endpoint, publisher.replay_endpoint or "off")
        return cls(publisher)

    def attach(self, llm: EngineClient) -> None:
        self.block_size = llm.info.layout.block_size
        llm.add_kv_event_listener(self.on_events)

    def on_events(self, events: list[KVEvent]) -> None:
        """AsyncLLM KV-event listener (step thread): one step's events, one batch."""
        batch = to_vllm_events(events, self.block_size)
        if not batch or self._closed:
            return
        try:
            self.publisher.publish(EventBatch(ts=time.time(), events=batch))
        except RuntimeError:  # closed meanwhile (shutdown with a step still running)
            return
        self.stats.batches += 1
        self.stats.events.update(type(ev).__name__ for ev in batch)

    def close(self) -> None:
        """After the engine stopped stepping: send what is queued, then close the sockets."""
        if self._closed:
            return
        self._closed = True
        try:
            self.publisher.flush(FLUSH_S)
        except TimeoutError as exc:
            log.warning("vLLM KV events: closing with batches unsent (%s)", exc)
        self.publisher.close()
