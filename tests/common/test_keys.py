"""The cache-key scheme: fixed vectors, so any change to the scheme breaks a test."""

import hashlib
import struct

import pytest

from ragserve.keys import (
    CHUNK_SCHEME,
    KEY_SCHEME,
    KVLayout,
    block_hashes,
    cacheable_blocks,
    chunk_key,
    hash_block,
    root_hash,
    store_key,
    tail_block,
)

ROOT = "b47c8b0d332603626220dbda1b6809e57e06d6560dffb1e8b234d038f73f24d4"
BLOCKS = [
    "721dea07ba219e835c1e93fcb898f779f0c39f5679b25b964cdfb4df22333e6c",
    "3f5b251fbe18cb8307f4c16d9497231d2f60f18da29eedc1fd180bfe8e37b06f",
]
SALTED = [
    "9219e720b5f930117de1113654fab75cb83a6527182e27da3a70b6dbde806808",
    "07e2463781f8b73ecef18ca48fa7e427cb168b315ac567ff400fa859f4c033a4",
]

CHUNK = "3a917696f9c7785382f8d637d3e97a1baaa5db526c45bea451a4568b6aad39cb"
CHUNK_AFTER_PREFIX = "a838e58967ba969bbc934501ceff3b06463d47bd6a68cc958a8f8d88387469ba"
CHUNK_SALTED = "0a432e36896168106a620cc53871bcb5fc1c62f0c3422e18ff73f1bd37f6d458"


def test_scheme_name_is_versioned():
    assert KEY_SCHEME == "ragserve-kv-v1"


def test_root_vector_and_definition():
    root = root_hash("tiny-llama@abc")
    assert root.hex() == ROOT
    lp = lambda b: struct.pack("<I", len(b)) + b  # noqa: E731
    assert root == hashlib.sha256(b"ragserve-kv-v1" + lp(b"tiny-llama@abc") + lp(b"")).digest()


def test_block_vectors_and_definition():
    root = root_hash("tiny-llama@abc")
    hashes = block_hashes(list(range(40)), 16, root)
    assert [h.hex() for h in hashes] == BLOCKS
    tokens = struct.pack("<16I", *range(16))
    manual = hashlib.sha256(root + struct.pack("<I", 64) + tokens + struct.pack("<I", 0)).digest()
    assert hashes[0] == manual


def test_partial_blocks_never_hashed():
    root = root_hash("m")
    assert block_hashes(list(range(15)), 16, root) == []
    assert len(block_hashes(list(range(47)), 16, root)) == 2
    assert block_hashes(list(range(32)), 16, root) == block_hashes(list(range(47)), 16, root)


def test_salt_changes_every_hash():
    root = root_hash("tiny-llama@abc")
    salted = block_hashes(list(range(40)), 16, root, cache_salt="tenant-a")
    assert [h.hex() for h in salted] == SALTED
    plain = block_hashes(list(range(40)), 16, root)
    assert all(a != b for a, b in zip(salted, plain, strict=True))
    other = block_hashes(list(range(40)), 16, root, cache_salt="tenant-b")
    assert all(a != b for a, b in zip(salted, other, strict=True))


def test_different_model_or_namespace_different_root():
    assert root_hash("a") != root_hash("b")
    assert root_hash("a") != root_hash("a", namespace="lora-1")
    # length framing: moving bytes between fields changes the hash
    assert root_hash("ab", "c") != root_hash("a", "bc")


def test_chain_resume_matches_full_chain():
    root = root_hash("m")
    tokens = list(range(100))
    full = block_hashes(tokens, 16, root, cache_salt="s")
    tail = block_hashes(tokens, 16, root, cache_salt="s", start=3, parent=full[2])
    assert full[3:] == tail
    assert hash_block(full[0], tokens[16:32]) == full[1]


def test_chain_depends_on_every_earlier_block():
    root = root_hash("m")
    a = block_hashes(list(range(64)), 16, root)
    tokens = list(range(64))
    tokens[3] = 999
    b = block_hashes(tokens, 16, root)
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_bad_inputs_rejected():
    with pytest.raises(ValueError):
        root_hash("")
    with pytest.raises(ValueError):
        block_hashes([1, 2], 0, root_hash("m"))
    with pytest.raises(ValueError):
        block_hashes([-1] * 16, 16, root_hash("m"))
    with pytest.raises(ValueError):
        hash_block(b"short", [1])


def test_layout_fingerprint_vector_and_sensitivity():
    layout = KVLayout("m@1", "bfloat16", 16, 30, 3, 64)
    assert layout.fingerprint() == "8d161be11b9a954e20b5fed89aec5eba"
    variants = [
        KVLayout("m@2", "bfloat16", 16, 30, 3, 64),
        KVLayout("m@1", "int8", 16, 30, 3, 64),
        KVLayout("m@1", "bfloat16", 32, 30, 3, 64),
        KVLayout("m@1", "bfloat16", 16, 30, 3, 64, tp_rank=1, tp_size=2),
        KVLayout("m@1", "bfloat16", 16, 30, 3, 64, layout="layer_major"),
    ]
    assert len({v.fingerprint() for v in variants} | {layout.fingerprint()}) == 6
    key = store_key(layout.fingerprint(), root_hash("x"))
    assert len(key) == 16 + 32 and key.startswith(bytes.fromhex(layout.fingerprint()))


def test_chunk_key_vectors_and_definition():
    assert CHUNK_SCHEME == "ragserve-chunk-v1"
    root = root_hash("tiny-llama@abc")
    assert chunk_key(root, list(range(40))).hex() == CHUNK
    assert chunk_key(root, list(range(40)), [1, 2]).hex() == CHUNK_AFTER_PREFIX
    assert chunk_key(root, list(range(40)), cache_salt="tenant-a").hex() == CHUNK_SALTED
    lp = lambda b: struct.pack("<I", len(b)) + b  # noqa: E731
    manual = b"ragserve-chunk-v1" + root + lp(b"") + lp(b"") + lp(struct.pack("<40I", *range(40)))
    assert chunk_key(root, list(range(40))) == hashlib.sha256(manual).digest()


def test_chunk_key_is_content_only_and_framed():
    root = root_hash("m")
    assert chunk_key(root, [5, 6, 7]) == chunk_key(root, [5, 6, 7])
    assert chunk_key(root, [5, 6, 7]) != chunk_key(root_hash("other"), [5, 6, 7])
    # the canonical prefix and the chunk are framed apart
    assert chunk_key(root, [6, 7], [5]) != chunk_key(root, [7], [5, 6])
    # never equal to a block hash of the same tokens
    assert chunk_key(root, list(range(16))) != block_hashes(list(range(16)), 16, root)[0]
    with pytest.raises(ValueError):
        chunk_key(root, [])
    with pytest.raises(ValueError):
        chunk_key(b"short", [1])


def test_the_last_token_is_never_cached():
    """A prompt of exactly k blocks caches k - 1 (the step computes its last token for the logits)."""
    assert [cacheable_blocks(n, 16) for n in (0, 1, 16, 17, 32, 33)] == [0, 0, 0, 1, 1, 2]


def test_tail_block_definition():
    """Disaggregated decode's tail (docs/disaggregation.md): the tokens after the cacheable blocks, the last one too."""
    root = root_hash("m")
    tokens = list(range(40))  # 2 cacheable blocks, tail = tokens 32..39 (the decode engine computes none of them)
    hashes = block_hashes(tokens, 16, root)
    count, key = tail_block(tokens, 16, root, hashes)
    lp = lambda b: struct.pack("<I", len(b)) + b  # noqa: E731
    manual = lp(b"ragserve-tail-v2") + hashes[1] + lp(struct.pack("<8I", *range(32, 40))) + lp(b"")
    assert (count, key) == (8, hashlib.sha256(manual).digest())
    assert tail_block(list(range(33)), 16, root, hashes)[0] == 1  # the last token alone in its block
    assert tail_block(list(range(32)), 16, root, hashes)[0] == 16  # a full last block: all of it
    assert tail_block([], 16, root, []) is None
    # the last token is part of the key: prompts differing only there have different tails
    assert tail_block(tokens[:-1] + [99], 16, root, hashes) != (count, key)
    # the salt is in block 0's hash, so it enters a tail key only when the tail is block 0
    assert tail_block([1, 2, 3], 16, root, [], "a") != tail_block([1, 2, 3], 16, root, [])
    assert tail_block(tokens, 16, root, hashes, "a") == tail_block(tokens, 16, root, hashes)
    assert key not in hashes
