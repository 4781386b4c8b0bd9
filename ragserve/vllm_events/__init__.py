"""vLLM's KV-event wire format, both directions: structs, --kv-events-config, publisher, subscriber."""

from ragserve.vllm_events.config import KVEventsConfig, offset_endpoint_port
from ragserve.vllm_events.publisher import ZmqEventPublisher
from ragserve.vllm_events.subscriber import Cold, Received, ZmqEventSubscriber
from ragserve.vllm_events.wire import (
    END_SEQ,
    END_SEQ_BYTES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    KVEventBatch,
    decode_batch,
    encode_batch,
)

__all__ = [
    "END_SEQ",
    "END_SEQ_BYTES",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "Cold",
    "EventBatch",
    "KVEvent",
    "KVEventBatch",
    "KVEventsConfig",
    "Received",
    "ZmqEventPublisher",
    "ZmqEventSubscriber",
    "decode_batch",
    "encode_batch",
    "offset_endpoint_port",
]
