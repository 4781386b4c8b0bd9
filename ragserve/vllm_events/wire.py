"""vLLM's KV-event wire format: msgspec structs declared with vLLM's options, field order and tags.

Checked against vllm/distributed/kv_events.py (see docs/interop.md for the commit). The batch is an
array `[ts, events, data_parallel_rank]`; each event is a msgpack map whose first key is `type` (the
class name), then the fields in declaration order, fields equal to their default left out. Fields
without a default (lora_id, medium, lora_name, ...) are always on the wire, even when None.
Decoding ignores fields this module does not know (vLLM adds optional ones over time).
"""

from __future__ import annotations

from typing import Any

import msgspec

# vLLM publishes a block hash as bytes (its sha256-based hash) or, with
# VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, as an unsigned 64-bit int.
BlockHash = bytes | int

MEDIUM_GPU = "GPU"
# Sequence number of the replay socket's end marker: -1 as 8 signed big-endian bytes, with an empty payload.
END_SEQ = -1
END_SEQ_BYTES = END_SEQ.to_bytes(8, "big", signed=True)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged union; the tag is the subclass's name under the key `type`."""


class BlockStored(KVCacheEvent):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None  # deprecated upstream in favour of lora_name, still on the wire
    medium: str | None
    lora_name: str | None
    # One entry per block: the extra inputs of that block's hash (cache_salt, LoRA name, mm hashes).
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    events: list[KVEvent]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: EventBatch) -> bytes:
    """The msgpack payload vLLM's publisher sends for this batch."""
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode one payload; raises msgspec.DecodeError (a ValueError) on bytes that are not a batch."""
    return _decoder.decode(payload)


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def decode_seq(frame: bytes) -> int:
    """A sequence frame as the subscriber reads it (signed, so the end marker reads -1)."""
    if len(frame) != 8:
        raise ValueError(f"sequence frame must be 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)
