"""The router's key for a chunked chat is its chunk set: the same documents in any order key alike."""

from __future__ import annotations

from ragserve.chunks import encode_chunked_chat
from ragserve.keys import chunk_key, root_hash
from ragserve.model_source import load_tokenizer, resolve_model
from ragserve_router.engines import ModelSpec
from ragserve_router.prompt import token_key
from tests.engine.test_blend_api import rag_messages
from tests.helpers.tiny_models import tiny_model


def test_chunk_set_key_ignores_order_and_matches_engine_chunk_keys():
    tok = load_tokenizer(resolve_model(str(tiny_model("llama"))))
    spec = ModelSpec("tiny@1", 16, tok.fingerprint())
    key = token_key(tok, spec, {"messages": rag_messages([0, 1, 2])}, True, None)
    reordered = token_key(tok, spec, {"messages": rag_messages([2, 0, 1])}, True, None)
    other = token_key(tok, spec, {"messages": rag_messages([0, 1])}, True, None)
    assert not key.exact and key.hashes == reordered.hashes and len(key.hashes) == 3
    assert other.hashes != key.hashes
    prompt = encode_chunked_chat(tok, rag_messages([0, 1, 2]))
    assert key.num_prompt_tokens == len(prompt.token_ids)
    assert set(key.hashes) == {chunk_key(root_hash("tiny@1"), t) for t in prompt.chunk_tokens()}
    salted = token_key(tok, spec, {"messages": rag_messages([0, 1, 2])}, True, "tenant")
    assert not set(salted.hashes) & set(key.hashes)


def test_plain_chats_keep_block_hashes():
    tok = load_tokenizer(resolve_model(str(tiny_model("llama"))))
    spec = ModelSpec("tiny@1", 16, tok.fingerprint())
    key = token_key(tok, spec, {"messages": [{"role": "user", "content": "hello " * 40}]}, True, None)
    assert key.exact and key.block_tokens == 16
