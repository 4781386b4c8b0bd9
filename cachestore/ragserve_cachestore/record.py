"""One stored KV block and its on-disk / in-Redis binary format (no pickle, no .npy).

Record = fixed 136-byte little-endian header + raw data bytes. The header carries
magic, version, dtype, shape, data length, the data checksum (xxh3_64, as in the
proto's `checksum`), the store key (so a renamed or misplaced file is detected)
and an xxh3_64 of the header itself.
"""

from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass

import xxhash

from ragserve.keys import HASH_BYTES

MAGIC = b"RSKV"
VERSION = 1
MAX_DIMS = 8
DTYPE_FIELD = 24
LAYOUT_BYTES = 16  # a 32-hex-char KV layout fingerprint
STORE_KEY_BYTES = LAYOUT_BYTES + HASH_BYTES
_HEAD = struct.Struct(f"<4sHBBQQ{DTYPE_FIELD}s{MAX_DIMS}I{STORE_KEY_BYTES}s")
_CHECK = struct.Struct("<Q")
HEADER_SIZE = _HEAD.size + _CHECK.size

DTYPE_SIZES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}
_LAYOUT_RE = re.compile(r"[0-9a-fA-F]{32}")


class CorruptRecord(ValueError):
    """A stored record whose header, length or checksum does not verify."""


def checksum(data: bytes) -> int:
    return xxhash.xxh3_64_intdigest(data)


@dataclass(frozen=True)
class StoredBlock:
    data: bytes
    dtype: str
    shape: tuple[int, ...]
    checksum: int

    @property
    def size(self) -> int:
        """Bytes this block costs in any tier's budget (header + data)."""
        return HEADER_SIZE + len(self.data)


def layout_error(layout: str) -> str | None:
    if not _LAYOUT_RE.fullmatch(layout or ""):
        return f"layout must be the engine's KV layout fingerprint (32 hex chars), got {layout[:40]!r}"
    return None


def key_error(key: bytes) -> str | None:
    if len(key) != HASH_BYTES:
        return f"block key must be {HASH_BYTES} bytes (a chained block hash), got {len(key)}"
    return None


def block_error(key: bytes, data: bytes, dtype: str, shape: tuple[int, ...], crc: int | None) -> str | None:
    """Why a block is not storable, or None. `crc=None` skips the checksum test."""
    if message := key_error(key):
        return message
    if dtype not in DTYPE_SIZES:
        return f"dtype {dtype[:32]!r} is not one of {sorted(DTYPE_SIZES)}"
    if not 1 <= len(shape) <= MAX_DIMS or min(shape) <= 0:
        return f"shape must have 1..{MAX_DIMS} positive dims, got {list(shape)[:16]}"
    if (need := math.prod(shape) * DTYPE_SIZES[dtype]) != len(data):
        return f"data is {len(data)} bytes but shape {list(shape)} of {dtype} needs {need}"
    if crc is not None and checksum(data) != crc:
        return "checksum does not match xxh3_64 of data"
    return None


def encode_header(skey: bytes, block: StoredBlock) -> bytes:
    shape = list(block.shape) + [0] * (MAX_DIMS - len(block.shape))
    head = _HEAD.pack(
        MAGIC,
        VERSION,
        len(block.shape),
        len(block.dtype),
        len(block.data),
        block.checksum,
        block.dtype.encode(),
        *shape,
        skey,
    )
    return head + _CHECK.pack(xxhash.xxh3_64_intdigest(head))


def decode(skey: bytes, record: bytes | memoryview) -> StoredBlock:
    """Parse and verify a record read back from disk or Redis; raise CorruptRecord."""
    if len(record) < HEADER_SIZE:
        raise CorruptRecord(f"truncated header ({len(record)} bytes)")
    head = bytes(record[: _HEAD.size])
    (expected,) = _CHECK.unpack_from(record, _HEAD.size)
    if xxhash.xxh3_64_intdigest(head) != expected:
        raise CorruptRecord("header checksum mismatch")
    magic, version, ndim, dtype_len, data_len, crc, dtype, *rest = _HEAD.unpack(head)
    shape, stored_key = tuple(rest[:ndim]), rest[MAX_DIMS]
    if magic != MAGIC or version != VERSION:
        raise CorruptRecord(f"bad magic/version {magic!r}/{version}")
    if stored_key != skey:
        raise CorruptRecord("record belongs to another key")
    if len(record) - HEADER_SIZE != data_len:
        raise CorruptRecord(f"data is {len(record) - HEADER_SIZE} bytes, header says {data_len}")
    data = bytes(record[HEADER_SIZE:])
    if checksum(data) != crc:
        raise CorruptRecord("data checksum mismatch")
    return StoredBlock(data=data, dtype=dtype[:dtype_len].decode(), shape=shape, checksum=crc)
