"""Golden bytes of vLLM's KV-event payloads: ragserve.vllm_events encodes and decodes exactly what vLLM does."""

import msgspec
import pytest

from ragserve.vllm_events import wire
from tests.interop import vllm_reference as ref

H1, H2 = bytes(range(32)), bytes(range(32, 64))
U64_MAX = 2**64 - 1


def _events(mod) -> list:
    """The same events built from either module's structs."""
    return [
        mod.BlockStored(
            block_hashes=[H1, H2],
            parent_block_hash=None,
            token_ids=[1, 2, 3, 4],
            block_size=2,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        ),
        mod.BlockStored(
            block_hashes=[U64_MAX, 7],
            parent_block_hash=5,
            token_ids=[9, 8, 7, 6],
            block_size=2,
            lora_id=3,
            medium="CPU",
            lora_name="adapter",
            extra_keys=[("salt-a",), None],
            group_idx=0,
            kv_cache_spec_kind="full_attention",
            kv_cache_spec_sliding_window=128,
        ),
        mod.BlockRemoved(block_hashes=[H2], medium="GPU"),
        mod.BlockRemoved(block_hashes=[7, U64_MAX], medium=None, group_idx=1),
        mod.AllBlocksCleared(),
    ]


def _explicit_layout() -> list:
    """The msgpack layout vLLM produces, spelled out: the batch an array, each event a map with `type` first,
    then the fields in declaration order; fields without a default always present, defaulted ones only when set."""
    return [
        1764700000.25,
        [
            {
                "type": "BlockStored",
                "block_hashes": [H1, H2],
                "parent_block_hash": None,
                "token_ids": [1, 2, 3, 4],
                "block_size": 2,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
            },
            {
                "type": "BlockStored",
                "block_hashes": [U64_MAX, 7],
                "parent_block_hash": 5,
                "token_ids": [9, 8, 7, 6],
                "block_size": 2,
                "lora_id": 3,
                "medium": "CPU",
                "lora_name": "adapter",
                "extra_keys": [["salt-a"], None],
                "group_idx": 0,
                "kv_cache_spec_kind": "full_attention",
                "kv_cache_spec_sliding_window": 128,
            },
            {"type": "BlockRemoved", "block_hashes": [H2], "medium": "GPU"},
            {"type": "BlockRemoved", "block_hashes": [7, U64_MAX], "medium": None, "group_idx": 1},
            {"type": "AllBlocksCleared"},
        ],
        2,
    ]


def _hex(*parts: str) -> bytes:
    return bytes.fromhex("".join(parts))


def test_hand_written_bytes() -> None:
    golden = _hex(
        "93",  # fixarray(3): [ts, events, data_parallel_rank]
        "cb3ff8000000000000",  # float64 1.5
        "91",  # fixarray(1)
        "81",  # fixmap(1)
        "a4" + b"type".hex(),
        "b0" + b"AllBlocksCleared".hex(),  # the tag: the class name
        "00",  # rank 0
    )
    batch = wire.EventBatch(ts=1.5, events=[wire.AllBlocksCleared()], data_parallel_rank=0)
    assert wire.encode_batch(batch) == golden
    assert wire.decode_batch(golden) == wire.KVEventBatch(1.5, [wire.AllBlocksCleared()], 0)
    removed = _hex(
        "83",  # fixmap(3): type first, then the fields in declaration order; group_idx (default None) left out
        "a4" + b"type".hex(),
        "ac" + b"BlockRemoved".hex(),
        "ac" + b"block_hashes".hex(),
        "9107",  # [7]
        "a6" + b"medium".hex(),
        "a3" + b"GPU".hex(),
    )
    assert msgspec.msgpack.encode(wire.BlockRemoved(block_hashes=[7], medium="GPU")) == removed
    stored = _hex(
        "88",  # fixmap(8): type + 7 fields; lora_id, medium, lora_name have no default, so nil is sent
        "a4" + b"type".hex(),
        "ab" + b"BlockStored".hex(),
        "ac" + b"block_hashes".hex(),
        "91c420" + H1.hex(),  # [bin8(32)]
        "b1" + b"parent_block_hash".hex(),
        "c0",
        "a9" + b"token_ids".hex(),
        "920102",
        "aa" + b"block_size".hex(),
        "02",
        "a7" + b"lora_id".hex(),
        "c0",
        "a6" + b"medium".hex(),
        "a3" + b"GPU".hex(),
        "a9" + b"lora_name".hex(),
        "c0",
    )
    event = wire.BlockStored([H1], None, [1, 2], 2, None, "GPU", None)
    assert msgspec.msgpack.encode(event) == stored


def test_encoding_matches_vllm_layout_and_structs() -> None:
    ours = wire.encode_batch(wire.EventBatch(ts=1764700000.25, events=_events(wire), data_parallel_rank=2))
    layout = msgspec.msgpack.encode(_explicit_layout())
    upstream = msgspec.msgpack.encode(ref.EventBatch(ts=1764700000.25, events=_events(ref), data_parallel_rank=2))
    assert ours == layout == upstream


def test_decode_to_expected_values() -> None:
    decoded = wire.decode_batch(msgspec.msgpack.encode(_explicit_layout()))
    assert decoded.ts == 1764700000.25 and decoded.data_parallel_rank == 2
    stored, stored2, removed, removed2, cleared = decoded.events
    assert isinstance(stored, wire.BlockStored) and stored.block_hashes == [H1, H2]
    assert (stored.parent_block_hash, stored.token_ids, stored.block_size) == (None, [1, 2, 3, 4], 2)
    assert stored.medium == "GPU"
    assert stored.extra_keys is None and stored.group_idx is None
    assert stored2.block_hashes == [U64_MAX, 7] and stored2.parent_block_hash == 5
    assert (stored2.lora_id, stored2.lora_name, stored2.extra_keys) == (3, "adapter", [("salt-a",), None])
    assert (stored2.group_idx, stored2.kv_cache_spec_kind, stored2.kv_cache_spec_sliding_window) == (
        0,
        "full_attention",
        128,
    )
    assert isinstance(removed, wire.BlockRemoved) and (removed.block_hashes, removed.medium) == ([H2], "GPU")
    assert (removed2.block_hashes, removed2.medium, removed2.group_idx) == ([7, U64_MAX], None, 1)
    assert isinstance(cleared, wire.AllBlocksCleared)
    assert decoded.events == _events(wire)


def test_batch_without_rank_keeps_the_slot() -> None:
    # omit_defaults does not shorten an array_like struct: the rank is sent as nil.
    ours = wire.encode_batch(wire.EventBatch(ts=2.0, events=[]))
    assert ours == msgspec.msgpack.encode([2.0, [], None]) == msgspec.msgpack.encode(ref.EventBatch(ts=2.0, events=[]))
    assert wire.decode_batch(ours).data_parallel_rank is None


def test_decoder_ignores_fields_added_upstream_and_refuses_garbage() -> None:
    layout = _explicit_layout()
    layout[1][2]["locality"] = "LOCAL"  # an optional field newer vLLM versions may send
    assert wire.decode_batch(msgspec.msgpack.encode(layout)).events[2] == wire.BlockRemoved([H2], "GPU")
    with pytest.raises(msgspec.ValidationError):
        wire.decode_batch(msgspec.msgpack.encode([1.0, [{"type": "BlockEvicted"}], 0]))
    with pytest.raises(msgspec.DecodeError):
        wire.decode_batch(b"\xc1")


def test_sequence_frames() -> None:
    assert wire.encode_seq(1) == b"\x00" * 7 + b"\x01"
    assert wire.END_SEQ_BYTES == b"\xff" * 8 and wire.decode_seq(wire.END_SEQ_BYTES) == -1
    with pytest.raises(ValueError, match="8 bytes"):
        wire.decode_seq(b"\x00")
