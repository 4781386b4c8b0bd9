"""`ragserve up` end to end: 2 engines on the tiny model behind the router (+ cachestore, Redis),
a request through the gateway, the RAG demo against it, health probes, and a clean shutdown."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import grpc
import httpx
import pytest

from ragserve.v1 import cachestore_pb2 as pb
from ragserve.v1 import cachestore_pb2_grpc as pb_grpc
from tests.helpers.cachestore import LAYOUT, chain
from tests.helpers.process import alive, wait_gone
from tests.helpers.stack import ROOT, Up, stack_env, tiny
from tests.helpers.threads import user_threads


def prom_value(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.split("{")[0].split(" ")[0] == name)


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("up")
    stack = Up(tmp, "--engines", "2", "--model", tiny(), "--served-model-name", "tiny", "--redis", "auto",
               "--num-gpu-blocks", "1024", "--max-model-len", "4096")  # fmt: skip
    stack.wait_ready()
    yield stack
    stack.cleanup()


def test_comes_up_with_every_process(up):
    state = up.state
    assert set(state["pids"]) == {"redis", "cachestore", "router", "engine-0", "engine-1", "embed-0"}
    assert all(alive(pid) for pid in up.child_pids)
    assert state["redis"].startswith("redis://127.0.0.1:") and state["cachestore"].startswith("127.0.0.1:")
    ready = httpx.get(state["url"] + "/ready", timeout=10).json()
    assert ready["healthy_engines"] == 3  # and the embedding engine
    out = up.output()
    assert "ragserve is up" in out and f"{state['url']}/v1" in out and "curl" in out
    assert "engine-0  |" in out and "router    |" in out  # child logs, prefixed


def test_engines_share_the_hosts_cores(up):
    """Two engines on one host: each runs cores / 2 torch threads, not every core each."""
    threads = user_threads() or max(1, len(os.sched_getaffinity(0)) // 2)  # the user's setting wins the split
    out = up.output().splitlines()
    for engine in ("engine-0", "engine-1"):
        started = [line for line in out if f"engine {engine}: http" in line]
        assert started and started[0].endswith(f"loading, {threads} torch threads"), started
        with open(f"/proc/{up.state['pids'][engine]}/environ", "rb") as f:
            assert f"OMP_NUM_THREADS={threads}".encode() in f.read().split(b"\0")


def test_serves_a_request_through_the_router(up):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4}
    resp = httpx.post(up.state["url"] + "/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-ragserve-engine"] in ("engine-0", "engine-1")
    assert resp.json()["usage"]["completion_tokens"] == 4
    models = httpx.get(up.state["url"] + "/v1/models", timeout=10).json()
    assert sorted(m["id"] for m in models["data"]) == ["all-minilm-l6-v2", "tiny"]


def test_serves_embeddings_through_the_router(up):
    """`ragserve up` starts an embedding engine (all-MiniLM-L6-v2) the router sends /v1/embeddings to."""
    body = {"model": "all-minilm-l6-v2", "input": ["What is a KV cache?", "Paged attention"]}
    resp = httpx.post(up.state["url"] + "/v1/embeddings", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-ragserve-engine"] == "embed-0"
    assert [len(d["embedding"]) for d in resp.json()["data"]] == [384, 384]
    assert up.state["embedding_model"] == "all-minilm-l6-v2" and len(up.state["embedding_engines"]) == 1
    assert "/v1/embeddings" in up.output()  # the banner says where
    query, docs = "Where is a KV cache kept?", ["Paged attention keeps it in blocks.", "Bananas are yellow."]
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):  # vLLM's aliases, routed like the rest
        resp = httpx.post(
            up.state["url"] + path, json={"model": "all-minilm-l6-v2", "query": query, "documents": docs}, timeout=60
        )
        assert resp.status_code == 200 and resp.headers["x-ragserve-engine"] == "embed-0", (path, resp.text)
        assert [r["index"] for r in resp.json()["results"]] == [0, 1]
    for path in ("/v1/score", "/score"):
        resp = httpx.post(
            up.state["url"] + path, json={"model": "all-minilm-l6-v2", "text_1": query, "text_2": docs}, timeout=60
        )
        assert resp.status_code == 200 and len(resp.json()["data"]) == 2, (path, resp.text)


def test_health_probe_command(up):
    def probe(target: str) -> int:
        cmd = [sys.executable, "-m", "ragserve.stack.health", target]
        return subprocess.run(cmd, capture_output=True, timeout=30).returncode

    assert probe(up.state["url"] + "/ready") == 0
    assert probe(up.state["engines"][0] + "/ready") == 0
    assert probe("grpc://" + up.state["cachestore"]) == 0
    assert probe(up.state["redis"]) == 0
    assert probe(up.state["url"] + "/no-such-path") == 1
    assert probe("http://127.0.0.1:1/ready") == 1
    assert probe("ftp://127.0.0.1:1") == 2


def test_demo_end_to_end_offline(up, tmp_path):
    out = tmp_path / "demo.json"
    env = stack_env()
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = [sys.executable, "-m", "ragserve.cli", "demo", "--url", up.state["url"], "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    results = json.loads(out.read_text())
    assert len(results) >= 10 and all(r["status"] == 200 and r["engine"] in ("engine-0", "engine-1") for r in results)
    assert all(r["prompt_tokens"] > 1000 and r["ttft_s"] > 0 for r in results)
    repeated = [r for r in results if r["repeated_context"]]
    assert repeated, "the built-in questions revisit documents"
    # a revisited document's context is served from cache (the router sends it where its KV is)
    assert all(r["cached_tokens"] > 0 for r in repeated)
    assert sum(r["cached_tokens"] for r in repeated) >= 0.8 * sum(r["prompt_tokens"] for r in repeated)
    assert "prompt tokens served from cache" in proc.stdout and "repeated context" in proc.stdout


def test_cachestore_takes_only_the_stacks_token(up):
    """up gives the cachestore a fresh token and hands it to the engines and the router: a client without it
    is refused, while the engines' own Puts of a request's new blocks go through."""
    with grpc.insecure_channel(up.state["cachestore"]) as channel, pytest.raises(grpc.RpcError) as refused:
        request = pb.LookupRequest(layout=LAYOUT, keys=chain(1))
        pb_grpc.CacheStoreStub(channel).Lookup(request, timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED

    def puts() -> float:
        metrics = httpx.get(up.state["cachestore_metrics"] + "/metrics", timeout=10).text
        return prom_value(metrics, "ragserve_cachestore_puts_total")

    before = puts()
    text = " ".join(f"token-check {i} {os.getpid()}" for i in range(60))  # a prompt no other test sends
    body = {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 2}
    resp = httpx.post(up.state["url"] + "/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    deadline = time.monotonic() + 30
    while puts() <= before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert puts() > before, "the engine offloaded the request's blocks with the token"


@pytest.mark.last_in_module
def test_sigterm_stops_everything(up):
    """Runs last in this module (the marker): SIGTERM to `ragserve up` stops every child it started, exit 0."""
    pids = up.child_pids
    assert up.stop(signal.SIGTERM, timeout=90) == 0, up.output()[-4000:]
    assert wait_gone(pids, timeout=5) == [], up.output()[-4000:]
    assert "stopping" in up.output()
