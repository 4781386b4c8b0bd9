"""End to end: a real router in front of real `ragserve engine` processes (tiny llama model)."""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.helpers import process

pytestmark = pytest.mark.slow  # many processes, each loading a model

DOCS = [" ".join(f"passage{d} sentence{i} states fact {i * 7 % 13}." for i in range(60)) for d in range(4)]


def rag(doc: int, question: str, **extra) -> dict:
    messages = [
        {"role": "system", "content": f"Answer from the context.\n\nContext:\n{DOCS[doc]}"},
        {"role": "user", "content": question},
    ]
    return {"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0, **extra}


def engines(router) -> int:
    return httpx.get(router.url + "/ready", timeout=5).json()["engines"]


@pytest.fixture(scope="module")
def stack(module_cluster):
    router = module_cluster.router("--heartbeat-interval-ms", "500", "--guard-abs", "3", "--allow-policy-header")
    fleet = module_cluster.real_engines(router, 3, "--num-gpu-blocks", "1024", "--max-model-len", "4096")
    process.until(lambda: engines(router) >= 3, timeout=60, interval=0.2, fail=False)
    assert engines(router) == 3, router.output()
    return module_cluster, router, fleet


def test_shared_prefix_lands_on_the_engine_that_holds_it(stack, metrics, until):
    _, router, _ = stack
    for doc in range(3):
        first = httpx.post(router.url + "/v1/chat/completions", json=rag(doc, "What is fact one?"), timeout=120)
        assert first.status_code == 200, first.text
        home = first.headers["x-ragserve-engine"]
        stored = metrics(router.url, "ragserve_router_kv_events_total", kind="stored")
        until(
            lambda s=stored: metrics(router.url, "ragserve_router_kv_events_total", kind="stored") >= s,
            message="KV events",
        )
        time.sleep(0.3)  # let the engine's event batch reach the router
        for q in range(2):
            resp = httpx.post(router.url + "/v1/chat/completions", json=rag(doc, f"And question {q}?"), timeout=120)
            usage = resp.json()["usage"]
            assert resp.headers["x-ragserve-engine"] == home
            assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 3 * 16
    predicted = metrics.total(router.url, "ragserve_router_predicted_cached_tokens_total")
    actual = metrics.total(router.url, "ragserve_router_actual_cached_tokens_total")
    assert actual > 0 and abs(predicted - actual) <= 0.05 * actual, (predicted, actual)


def test_hot_prefix_spreads_once_the_guard_trips(stack, metrics):
    _, router, _ = stack
    assert httpx.post(router.url + "/v1/chat/completions", json=rag(3, "warm"), timeout=120).status_code == 200
    before = metrics(router.url, "ragserve_router_routing_decisions_total", policy="kv_aware", reason="imbalance_guard")
    used: list[str] = []
    barrier = threading.Barrier(12)

    def one(i: int) -> None:
        body = rag(3, f"hot question {i}", stream=True, max_tokens=128, ignore_eos=True)
        barrier.wait()
        with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=300) as resp:
            assert resp.status_code == 200
            used.append(resp.headers["x-ragserve-engine"])
            resp.read()

    with ThreadPoolExecutor(12) as pool:
        list(pool.map(one, range(12)))
    assert len(set(used)) >= 2, used
    after = metrics(router.url, "ragserve_router_routing_decisions_total", policy="kv_aware", reason="imbalance_guard")
    assert after > before


def test_openai_sdk_unmodified(stack):
    _, router, _ = stack
    sdk = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in sdk.models.list()] == ["tiny"]
    chat = sdk.chat.completions.create(**rag(0, "Say something"))
    assert chat.choices[0].finish_reason in ("length", "stop") and chat.usage.prompt_tokens > 100
    chunks = list(
        sdk.chat.completions.create(**rag(1, "Stream it"), stream=True, stream_options={"include_usage": True})
    )
    assert any(c.choices and c.choices[0].delta.content for c in chunks) and chunks[-1].usage.completion_tokens == 4
    pieces = list(sdk.completions.create(model="tiny", prompt=DOCS[2], max_tokens=4, stream=True))
    assert pieces and all(p.model == "tiny" for p in pieces)
    sdk.close()


def test_engine_killed_under_load(stack, until):
    """Runs last: SIGKILL one engine under load; no client errors; it leaves; a restart rejoins."""
    cluster, router, fleet = stack
    victim = fleet[0]
    stop = threading.Event()

    def load(i: int) -> list[int]:
        codes = []
        with httpx.Client(timeout=120) as client:
            while not stop.is_set():
                resp = client.post(router.url + "/v1/chat/completions", json=rag(i % 4, f"load {i} {len(codes)}"))
                codes.append(resp.status_code)
        return codes

    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(load, i) for i in range(6)]
        time.sleep(2)
        victim.stop(signal.SIGKILL)
        until(lambda: engines(router) == 2, timeout=30, message="dead engine dropped")
        time.sleep(1)
        stop.set()
        codes = [c for f in futures for c in f.result()]
    assert len(codes) >= 10 and set(codes) == {200}, sorted(set(codes))
    [restarted] = cluster.real_engines(router, 1, "--num-gpu-blocks", "1024", ports=[victim.port])
    until(lambda: engines(router) == 3, timeout=60, message="restarted engine rejoined")
