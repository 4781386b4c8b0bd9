"""The on-disk / in-Redis record format: round trip, and every kind of damage is detected."""

import pytest

from ragserve.keys import store_key
from ragserve_cachestore.record import (
    HEADER_SIZE,
    CorruptRecord,
    StoredBlock,
    block_error,
    checksum,
    decode,
    encode_header,
    layout_error,
)
from tests.helpers.cachestore import LAYOUT, OTHER_LAYOUT, chain

KEY = store_key(LAYOUT, chain(1)[0])
DATA = bytes(range(256)) * 8
BLOCK = StoredBlock(DATA, "float16", (2, 4, 128), checksum(DATA))


def record() -> bytearray:
    return bytearray(encode_header(KEY, BLOCK) + DATA)


def test_round_trip_preserves_everything():
    rec = record()
    assert len(rec) == HEADER_SIZE + len(DATA) == BLOCK.size
    assert decode(KEY, bytes(rec)) == BLOCK


def test_header_is_fixed_size_and_not_pickle():
    rec = record()
    assert rec[:4] == b"RSKV" and b"\x80\x04" not in rec[:2]  # no pickle protocol marker
    other = StoredBlock(b"\x00" * 2, "int8", (2,), checksum(b"\x00" * 2))
    assert len(encode_header(KEY, other)) == len(encode_header(KEY, BLOCK)) == HEADER_SIZE


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda r: r.__setitem__(HEADER_SIZE + 10, r[HEADER_SIZE + 10] ^ 1), "data checksum"),
        (lambda r: r.__setitem__(20, r[20] ^ 1), "header checksum"),
        (lambda r: r.__delitem__(slice(len(r) - 100, None)), "header says"),
        (lambda r: r.__delitem__(slice(50, None)), "truncated header"),
        (lambda r: r.extend(b"junk"), "header says"),
        (lambda r: r.clear(), "truncated header"),
    ],
    ids=["data-bit-flip", "header-bit-flip", "truncated-data", "truncated-header", "trailing-bytes", "empty"],
)
def test_damage_is_detected(damage, message):
    rec = record()
    damage(rec)
    with pytest.raises(CorruptRecord, match=message):
        decode(KEY, bytes(rec))


def test_record_of_another_key_or_layout_is_rejected():
    with pytest.raises(CorruptRecord, match="another key"):
        decode(store_key(LAYOUT, chain(2)[1]), bytes(record()))
    with pytest.raises(CorruptRecord, match="another key"):
        decode(store_key(OTHER_LAYOUT, chain(1)[0]), bytes(record()))


def test_block_validation_messages():
    key = chain(1)[0]
    assert block_error(key, DATA, "float16", (2, 4, 128), checksum(DATA)) is None
    assert "32 bytes" in block_error(b"short", DATA, "float16", (1024,), None)
    assert "dtype 'pickle'" in block_error(key, DATA, "pickle", (1024,), None)
    assert "needs 4096" in block_error(key, DATA, "float32", (1024,), None)
    assert "positive dims" in block_error(key, DATA, "int8", (), None)
    assert "positive dims" in block_error(key, DATA, "int8", (0, 5), None)
    assert "checksum" in block_error(key, DATA, "int8", (2048,), checksum(DATA) ^ 1)


def test_layout_validation():
    assert layout_error(LAYOUT) is None
    for bad in ("", "xyz", LAYOUT[:-1], LAYOUT + "0", "g" * 32):
        assert "32 hex chars" in layout_error(bad)
