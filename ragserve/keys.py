"""The cache-key scheme shared by engine, router and cachestore (see docs/architecture.md).

root  = SHA-256(b"ragserve-kv-v1" | lp(model_id) | lp(namespace))
h_i   = SHA-256(h_{i-1} | lp(u32le(tokens of block i)) | lp(extra_i))

lp(x) is x prefixed with its length as u32le, so no two inputs frame alike.
Only full blocks are hashed; a request's cache_salt is block 0's extra.

Chunks (retrieved documents reused at any position, docs/blend.md) are keyed by content alone:
chunk = SHA-256(b"ragserve-chunk-v1" | root | lp(salt) | lp(u32le(canonical prefix)) | lp(u32le(tokens)))
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import asdict, dataclass

KEY_SCHEME = "ragserve-kv-v1"
CHUNK_SCHEME = "ragserve-chunk-v1"
TAIL_SCHEME = "ragserve-tail-v2"  # v1 left the last prompt token out
HASH_BYTES = 32
_LITTLE = sys.byteorder == "little"


def _lp(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


def _pack_tokens(token_ids: Sequence[int]) -> bytes:
    if isinstance(token_ids, array) and token_ids.typecode == "I" and token_ids.itemsize == 4 and _LITTLE:
        return token_ids.tobytes()  # u32le already
    try:
        return struct.pack(f"<{len(token_ids)}I", *token_ids)
    except struct.error as exc:
        raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from None


def root_hash(model_id: str, namespace: str = "") -> bytes:
    """Chain root for a model; different weights or namespaces never share keys."""
    if not model_id:
        raise ValueError("model_id must be non-empty")
    data = KEY_SCHEME.encode() + _lp(model_id.encode()) + _lp(namespace.encode())
    return hashlib.sha256(data).digest()


def hash_block(parent: bytes, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
    """Hash of one full block chained onto its parent's hash."""
    return _chain(_checked_parent(parent), _lp(_pack_tokens(token_ids)), _lp(extra))


def _checked_parent(parent: bytes) -> bytes:
    if len(parent) != HASH_BYTES:
        raise ValueError(f"parent hash must be {HASH_BYTES} bytes, got {len(parent)}")
    return parent


def _chain(parent: bytes, framed_tokens: bytes, framed_extra: bytes) -> bytes:
    """h_i from its parent, lp(u32le(tokens of block i)) and lp(extra_i)."""
    return hashlib.sha256(parent + framed_tokens + framed_extra).digest()


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    root: bytes,
    cache_salt: str | None = None,
    start: int = 0,
    parent: bytes | None = None,
) -> list[bytes]:
    """Chained hashes of the full blocks of `token_ids`.

    `start`/`parent` resume an existing chain: hash blocks start, start+1, ...
    given the hash of block start-1 (or the root when start == 0).
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    prev = root if start == 0 else parent
    if prev is None:
        raise ValueError("parent hash is required when start > 0")
    _checked_parent(prev)
    end = len(token_ids) // block_size
    if start >= end:
        return []
    packed = _pack_tokens(token_ids[start * block_size : end * block_size])  # every block's tokens, packed once
    salt = cache_salt.encode() if cache_salt and start == 0 else b""
    return hash_packed(prev, packed, block_size, salt)


def hash_packed(parent: bytes, packed: bytes, block_size: int, first_extra: bytes = b"") -> list[bytes]:
    """The chain from `parent` over `packed` (the u32le tokens of whole blocks); `first_extra`: the first block's
    extra (the salt, when it is block 0)."""
    size, framing = 4 * block_size, struct.pack("<I", 4 * block_size)  # lp()'s prefix: every block has this size
    extras = (_lp(first_extra), _lp(b""))
    out: list[bytes] = []
    prev = parent
    for i, at in enumerate(range(0, len(packed), size)):
        prev = _chain(prev, framing + packed[at : at + size], extras[i > 0])
        out.append(prev)
    return out


def cacheable_blocks(num_tokens: int, block_size: int) -> int:
    """Full blocks of a prompt that may be cached, hit or fetched: the last token is never cached (a step must
    compute it for its logits), so a prompt of exactly k blocks caches k - 1."""
    return max(0, (num_tokens - 1) // block_size)


def tail_block(
    token_ids: Sequence[int], block_size: int, root: bytes, hashes: Sequence[bytes], cache_salt: str | None = None
) -> tuple[int, bytes] | None:
    """A prompt's tail: the tokens after its cacheable full blocks, its last token included (1 to block_size
    tokens), as (count, key); None for an empty prompt. Disaggregated prefill stores the tail's block under this key,
    so the decode engine holds the KV of every prompt token and computes none of them again.
    `hashes`: the prompt's full-block hashes.
    key = SHA-256("ragserve-tail-v2" | parent | lp(u32le(tail tokens)) | lp(salt when the tail is block 0)),
    parent = the hash of the last cacheable block, or the root."""
    start = cacheable_blocks(len(token_ids), block_size) * block_size
    tail = token_ids[start:]
    if not tail:
        return None
    parent = hashes[start // block_size - 1] if start else root
    salt = cache_salt.encode() if cache_salt and not start else b""
    data = _lp(TAIL_SCHEME.encode()) + parent + _lp(_pack_tokens(tail)) + _lp(salt)
    return len(tail), hashlib.sha256(data).digest()


def chunk_key(
    root: bytes, token_ids: Sequence[int], canonical_prefix: Sequence[int] = (), cache_salt: str | None = None
) -> bytes:
    """Content key of a chunk's KV, computed after `canonical_prefix` (not part of the chunk) at position 0.

    Independent of where the chunk appears in a prompt; `root` (root_hash) binds the weights and namespace.
    """
    if len(root) != HASH_BYTES:
        raise ValueError(f"root must be {HASH_BYTES} bytes, got {len(root)}")
    if not token_ids:
        raise ValueError("a chunk must have at least one token")
    salt = cache_salt.encode() if cache_salt else b""
    data = CHUNK_SCHEME.encode() + root + _lp(salt) + _lp(_pack_tokens(canonical_prefix)) + _lp(_pack_tokens(token_ids))
    return hashlib.sha256(data).digest()


@dataclass(frozen=True)
class KVLayout:
    """What makes two engines' KV blocks byte-compatible in the cachestore."""

    model_id: str
    kv_dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layout: str = "block_major"
    tp_rank: int = 0
    tp_size: int = 1

    def fingerprint(self) -> str:
        canonical = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:32]


def store_key(layout_fingerprint: str, block_hash: bytes) -> bytes:
    """Cachestore key: layout namespace + block hash."""
    return bytes.fromhex(layout_fingerprint) + block_hash


# A fixed chat long enough for several blocks: engine and router must hash it identically.
PROBE_MESSAGES = [
    {"role": "system", "content": "You answer questions using the retrieved context."},
    {
        "role": "user",
        "content": "Context: PagedAttention stores the KV cache in fixed-size blocks; prefix caching "
        "reuses the blocks of a shared prompt prefix across requests, keyed by chained hashes.\n\n"
        "Question: why does a RAG serving stack care about identical block hashes on every node?",
    },
]


def probe_hashes(tokenizer, block_size: int, model_id: str) -> list[bytes]:
    """Hashes of PROBE_MESSAGES as this process renders, tokenizes and hashes them."""
    return block_hashes(tokenizer.encode_chat(PROBE_MESSAGES), block_size, root_hash(model_id))
