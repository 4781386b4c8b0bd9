"""Chunk routing through a real router (Redis state) and real engines (docs/blend.md, "Sharing and routing").

Engines publish the content keys of the chunks they store as KV events; the router keys a chunked chat by its
chunk set. Chunks are first computed by requests sent to one engine directly, so the router learns where they
are only from that engine's events, never from its own routing history.

The router runs kv_aware with a large --work-weight: the prefill a chunk hit saves then outweighs, many times
over, what the engines' measured speeds can differ by (one step slowed by another process on the same cores
moved a decode estimate enough to send a request away from its chunks at the default weight), so where the
chunks are decides, which is what these tests are about. Requests generate one token for the same reason.
"""

from __future__ import annotations

import httpx
import pytest
import redis

from ragserve.chunks import encode_chunked_chat
from ragserve.keys import chunk_key, root_hash
from ragserve.tokenizer import PromptTokenizer
from ragserve_router.engines import EngineRecord
from tests.helpers import process

DOCS = [
    f"Warehouse {d} inventory. " + " ".join(f"Shelf {i} of warehouse {d} holds {i * 7 % 13} crates." for i in range(24))
    for d in range(6)
]  # fmt: skip
IDS = ["blend-0", "blend-1", "blend-2"]


def chat(docs: list[int], question: str) -> dict:
    parts = [{"type": "text", "text": "Documents:\n"}]
    for d in docs:
        parts += [{"type": "text", "text": DOCS[d], "ragserve_chunk": True}, {"type": "text", "text": "\n"}]
    parts.append({"type": "text", "text": f"Question: {question}"})
    messages = [{"role": "system", "content": "Answer from the documents."}, {"role": "user", "content": parts}]
    return {"model": "tiny", "messages": messages, "max_tokens": 1, "temperature": 0}


def post(url: str, body: dict) -> httpx.Response:
    resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp


def reused(resp: httpx.Response) -> int:
    return resp.json()["usage"]["prompt_tokens_details"].get("blend_reused_tokens", 0)


def wait_registered(engine) -> None:
    """Until the engine's /ready says the router acknowledged its registration (the router writes the record
    to Redis before it answers). Fails at once if the engine exits; the timeout only bounds a hung start."""

    def registered() -> bool:
        r = httpx.get(engine.url + "/ready", timeout=5)
        return r.status_code == 200 and r.json().get("registered") is True

    process.until(registered, timeout=300, interval=0.2, what=f"{engine.name} registered with the router", proc=engine)


@pytest.fixture(scope="module")
def stack(module_cluster):
    url = module_cluster.redis()
    router = module_cluster.router("--redis", url, "--heartbeat-interval-ms", "300", "--work-weight", "50")
    engines = module_cluster.real_engines(router, 3, "--num-gpu-blocks", "512", ids=IDS)
    for engine in engines:
        wait_registered(engine)
    index = redis.Redis.from_url(url)
    assert sorted(k.decode() for k in index.hkeys("ragserve:engines")) == IDS
    yield router, dict(zip(IDS, engines, strict=True)), index
    index.close()


def chunk_keys(index: redis.Redis, model_dir, docs: list[int]) -> list[bytes]:
    """The chunk keys an engine stores for these documents (its model id from its registration)."""
    record = EngineRecord.from_json(index.hget("ragserve:engines", IDS[0]))
    prompt = encode_chunked_chat(PromptTokenizer.from_dir(model_dir), chat(docs, "q")["messages"])
    return [chunk_key(root_hash(record.model_id), t) for t in prompt.chunk_tokens()]


def indexed(index: redis.Redis, engine_id: str, keys: list[bytes]) -> bool:
    return all(index.smismember(f"ragserve:blocks:{engine_id}", keys))


def test_reordered_documents_go_where_their_chunks_were_published(stack, model_dir):
    router, engines, index = stack
    homes = {"blend-1": [0, 1, 2], "blend-2": [3, 4, 5]}
    for engine_id, docs in homes.items():
        post(engines[engine_id].url, chat(docs, "Which shelf holds the most crates?"))  # not through the router
        keys = chunk_keys(index, model_dir, docs)
        process.until(lambda e=engine_id, k=keys: indexed(index, e, k), timeout=30, what=f"{engine_id}'s chunk keys")
        assert not any(indexed(index, other, keys[:1]) for other in IDS if other != engine_id)
    for engine_id, docs in homes.items():
        for order, question in [([2, 0, 1], "How many crates on shelf 3?"), ([1, 2], "What is shelf 5?")]:
            resp = post(router.url, chat([docs[i] for i in order], question))
            assert resp.headers["x-ragserve-engine"] == engine_id
            assert reused(resp) > 0
