"""A real `ragserve router` routes unmodified-vLLM-like engines from their KV events (--external-engine):
two `ragserve engine` processes with no --router publish vLLM's ZMQ events, the router follows them, and a
RAG prompt an engine already prefilled (sent to it directly, so the router's own routing history knows
nothing of it) goes back to that engine with reason prefix_hit and exactly the cached tokens it predicted."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ragserve.vllm_events import BlockStored, ZmqEventSubscriber
from tests.helpers.engine_server import LONG_CONTEXT, MODEL_NAME, EngineProc, start_engine
from tests.helpers.net import free_port, free_ports
from tests.helpers.process import Proc, start, until, wait_http
from tests.helpers.tiny_models import tiny_model

pytestmark = pytest.mark.timeout(600)
ROOT = Path(__file__).resolve().parents[2]
BS = 16


def rag_messages(doc: str) -> list[dict]:
    return [
        {"role": "system", "content": "Answer from the retrieved passages only."},
        {"role": "user", "content": f"Passages ({doc}):\n{LONG_CONTEXT}\nQuestion: what does {doc} say?"},
    ]


def router_metrics(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def publishing_engine(tmp: Path, ports: tuple[int, int, int] | None = None) -> tuple[EngineProc, str, str]:
    """A ragserve engine with no --router that publishes vLLM KV events on concrete loopback ports
    (ports: HTTP, events, replay; the same ones again restart the engine where the router expects it)."""
    http_port, pub_port, replay_port = ports or free_ports(3)
    pub, replay = f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}"
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub, "replay_endpoint": replay}
    args = ("--kv-events-config", json.dumps(config), "--kv-events-bind", "--device", "cpu")
    return start_engine(tmp, *args, port=http_port), pub, replay


def start_router(tmp: Path, *flags: str, grpc_port: int | None = None) -> tuple[Proc, str]:
    port = free_port()
    argv = [sys.executable, "-m", "ragserve.cli", "router", "--host", "127.0.0.1", "--port", str(port)]
    argv += [
        "--grpc-port",
        str(grpc_port or free_port()),
        "--registry-allow-unauthenticated",
        "--probe-interval",
        "0.5",
    ]
    argv += ["--approx-pending-ttl", "0", *flags]  # only the KV events can tell where a prompt is cached
    path = os.pathsep.join(filter(None, (os.environ.get("PYTHONPATH"), str(ROOT))))
    proc = start("router", argv, tmp / f"router-{port}.log", env={**os.environ, "PYTHONPATH": path})
    return proc, f"http://127.0.0.1:{port}"


async def published(pub: str, replay: str) -> int:
    """BlockStored events the engine has published so far (replayed from its first batch)."""
    sub = ZmqEventSubscriber(pub, replay)
    try:
        return sum(isinstance(ev, BlockStored) for item in await sub.catch_up() for ev in item.batch.events)
    finally:
        sub.close()


def ports_of(engine: EngineProc, pub: str, replay: str) -> tuple[int, int, int]:
    return engine.port, int(pub.rsplit(":", 1)[1]), int(replay.rsplit(":", 1)[1])


def test_router_routes_external_engines_from_their_kv_events(tmp_path):
    """Two engines seen only through their vLLM events. doc-0 is prefilled on external-0 before the router
    starts (its follower must replay it); then a multi-document trace through the router, each request sent
    once the router has applied every BlockStored published so far: every repeat is an exact prefix hit and
    every prediction equals the cached tokens the engine reports. Then external-0 restarts on the same ports:
    the router must take it as cold (no hit predicted on an empty cache), and exact again from its new events."""
    started = [publishing_engine(tmp_path) for _ in range(2)]
    engines = [e for e, _, _ in started]
    router = None
    try:
        for engine in engines:
            engine.wait_ready(timeout=300)
        body = {"model": MODEL_NAME, "messages": rag_messages("doc-0"), "max_tokens": 1, "temperature": 0}
        assert httpx.post(engines[0].url + "/v1/chat/completions", json=body, timeout=120).status_code == 200
        flags = [f for e, pub, rep in started for f in ("--external-engine", f"{e.url},events={pub},replay={rep}")]
        router, url = start_router(tmp_path, *flags, "--tokenizer", str(tiny_model("llama")))
        wait_http(url + "/health", proc=router, timeout=60)
        until(lambda: httpx.get(url + "/ready").json()["healthy_engines"] == 2, timeout=60, what="engines healthy")

        def applied() -> float:
            return value(router_metrics(url), "ragserve_router_kv_events_total", kind="stored")

        def caught_up(base: float = 0.0) -> None:  # the router applied every BlockStored published since base
            stored = sum(asyncio.run(published(pub, rep)) for _, pub, rep in started)
            until(lambda: applied() - base >= stored, timeout=30, what=f"the router applied {stored} BlockStored")

        seen: dict[str, str] = {"doc-0": "external-0"}
        for doc in ("doc-0", "doc-1", "doc-2", "doc-1", "doc-3", "doc-2", "doc-0", "doc-3"):
            caught_up()
            resp, hit, predicted = routed_hit(url, MODEL_NAME, doc)
            engine_id = resp.headers["x-ragserve-engine"]
            cached = resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert predicted == cached, (doc, engine_id, predicted, cached)
            if doc in seen:  # a repeat (doc-0's first one recovered by replay): home, and an exact hit
                assert (engine_id, hit) == (seen[doc], 1) and cached > 10 * BS, (doc, engine_id, hit, cached)
            seen.setdefault(doc, engine_id)

        caught_up()
        ports = ports_of(*started[0])
        engines[0].stop()
        until(lambda: httpx.get(url + "/ready").json()["healthy_engines"] == 1, timeout=60, what="engine 0 down")
        base = applied() - asyncio.run(published(*started[1][1:]))  # what the old external-0 contributed
        started[0] = publishing_engine(tmp_path, ports)
        engines[0] = started[0][0]
        engines[0].wait_ready(timeout=300)
        until(lambda: httpx.get(url + "/ready").json()["healthy_engines"] == 2, timeout=60, what="engine 0 back")
        doc = next(d for d, e in seen.items() if e == "external-0")
        resp, hit, predicted = routed_hit(url, MODEL_NAME, doc)  # its blocks died with the old process
        cached = resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert (hit, predicted, cached) == (0, 0, 0), (resp.headers["x-ragserve-engine"], hit, predicted, cached)

        body = {"model": MODEL_NAME, "messages": rag_messages("doc-4"), "max_tokens": 1, "temperature": 0}
        assert httpx.post(engines[0].url + "/v1/chat/completions", json=body, timeout=120).status_code == 200
        caught_up(base)  # the new process's events, from its sequence 0
        resp, hit, predicted = routed_hit(url, MODEL_NAME, "doc-4")
        cached = resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert resp.headers["x-ragserve-engine"] == "external-0" and hit == 1, resp.headers
        assert predicted == cached > 10 * BS, (predicted, cached)
    finally:
        if router is not None:
            router.stop()
        for engine in engines:
            engine.stop()


def test_wrong_block_size_is_refused_and_routed_on_load(tmp_path):
    engine, pub, rep = publishing_engine(tmp_path)
    router = None
    try:
        engine.wait_ready(timeout=300)
        flags = ["--external-engine", f"{engine.url},events={pub},replay={rep}", "--external-block-size", "32"]
        router, url = start_router(tmp_path, *flags, "--tokenizer", str(tiny_model("llama")))
        wait_http(url + "/health", proc=router, timeout=60)
        until(lambda: httpx.get(url + "/ready").json()["healthy_engines"] == 1, timeout=60, what="engine healthy")
        body = {"model": MODEL_NAME, "messages": rag_messages("doc-c"), "max_tokens": 1, "temperature": 0}
        refusal = "publishes blocks of 16 tokens but the pool hashes 32-token blocks"
        for _ in range(2):  # the first one's BlockStored makes the follower refuse the engine; it is still routed
            resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
            assert resp.status_code == 200 and resp.headers["x-ragserve-engine"] == "external-0", resp.text
            until(lambda: refusal in router.log.read_text(), timeout=30, what="the refusal logged")
        assert "routed on load (and routing history) only" in router.log.read_text()
        assert "run vLLM with --block-size 32" in router.log.read_text()
    finally:
        if router is not None:
            router.stop()
        engine.stop()


def routed_hit(url: str, model: str, doc: str) -> tuple[httpx.Response, float, float]:
    """One request through the router: its response, and the kv_aware prefix_hit and predicted-cached deltas."""
    hits, predicted = "ragserve_router_routing_decisions_total", "ragserve_router_predicted_cached_tokens_total"
    before = router_metrics(url)
    body = {"model": model, "messages": rag_messages(doc), "max_tokens": 1, "temperature": 0}
    resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    after, engine = router_metrics(url), resp.headers["x-ragserve-engine"]
    hit = value(after, hits, policy="kv_aware", reason="prefix_hit") - value(
        before, hits, policy="kv_aware", reason="prefix_hit"
    )
    return resp, hit, value(after, predicted, engine=engine) - value(before, predicted, engine=engine)


def test_registered_and_external_engines_behind_one_router(tmp_path):
    """A registered ragserve engine (its own gRPC events, model tiny-llama-reg) and an external one (vLLM
    events, model tiny-llama) behind one router: each serves its model, and a document it prefilled comes
    back as a prefix hit from the exact index (no routing history: --approx-pending-ttl 0) with exactly the
    cached tokens the router predicted."""
    grpc_port = free_port()
    external, pub, rep = publishing_engine(tmp_path)
    registered = start_engine(
        tmp_path, "--router", f"127.0.0.1:{grpc_port}", "--served-model-name", "tiny-llama-reg", "--engine-id", "reg-0"
    )
    router = None
    try:
        for engine in (external, registered):
            engine.wait_ready(timeout=300)
        flags = ["--external-engine", f"{external.url},events={pub},replay={rep}"]
        router, url = start_router(tmp_path, *flags, "--tokenizer", str(tiny_model("llama")), grpc_port=grpc_port)
        wait_http(url + "/health", proc=router, timeout=60)
        until(lambda: httpx.get(url + "/ready").json()["healthy_engines"] == 2, timeout=60, what="engines healthy")
        models = {m["id"] for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]}
        assert {MODEL_NAME, "tiny-llama-reg"} <= models

        for model, engine_id, doc in ((MODEL_NAME, "external-0", "doc-x"), ("tiny-llama-reg", "reg-0", "doc-r")):
            resp, _, _ = routed_hit(url, model, doc)  # prefills the document there (the model's only engine)
            assert resp.headers["x-ragserve-engine"] == engine_id
            # once its KV events reached the index (only that engine serves the model: repeats are harmless)
            resp, _, predicted = until(
                lambda m=model, d=doc: (r := routed_hit(url, m, d))[1] == 1 and r,
                timeout=60,
                interval=0.5,
                what=f"a prefix hit on {engine_id}",
            )
            assert resp.headers["x-ragserve-engine"] == engine_id
            cached = resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached > 10 * BS and predicted == cached, (engine_id, predicted, cached)
    finally:
        if router is not None:
            router.stop()
        for engine in (external, registered):
            engine.stop()
