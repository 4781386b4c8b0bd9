"""Disaggregated prefill/decode through the router, real processes: a cachestore, a --role prefill and a --role
decode engine on the tiny model, and a `both` engine alone for reference. Greedy answers through 1P1D equal the
reference token for token; the decode engine fetched the prompt (it computed no prompt token: it started from the
prefill engine's first token; with n > 1, only the last prompt token) and both engines
count the KV bytes they moved; faults in a 2P2D fleet (decode engine killed mid-stream, prefill engine killed
mid-prefill with another to retry on and with none left, store down) lose no request."""

from __future__ import annotations

import json
import signal
import threading
from dataclasses import dataclass

import httpx
import pytest

from tests.helpers.cachestore import CacheStoreProcess
from tests.helpers.net import free_port
from tests.helpers.process import frozen, until
from tests.router.conftest import Cluster, Server, case_file, running, scrape

pytestmark = pytest.mark.slow  # several processes, each loading a model
ENGINE_FLAGS = ["--num-gpu-blocks", "1024", "--max-model-len", "4096"]
LEGS = "ragserve_router_disagg_prefill_legs_total"
FETCHED = "vllm:external_prefix_cache_hits_total"
LEG_S, DECODE_TTFT = "ragserve_router_disagg_prefill_seconds", "ragserve_router_disagg_decode_ttft_seconds"


@dataclass
class PD:
    router: Server
    prefill: Server
    decode: Server
    store: CacheStoreProcess
    more_prefill: list[Server]
    more_decode: list[Server]


# The fault tests' routers: the session policy ranks the prefill engines by the body's `user`, so the leg goes to the
# same engine again. Under kv_aware the engine holding the prompt and one that would fetch it from the store are a
# near-tie on the tiny model (~0.002-0.03 s apart, within the spread of their calibrated step times).
SESSION = ("--policy", "session")


def start_pd(
    cluster: Cluster, tmp, heartbeat_ms: int = 300, engines: int = 1, decoders: int | None = None, *router_flags: str
) -> PD:
    """A cachestore, a router (with `router_flags` added), `engines` prefill engines and `decoders` (default: as many)
    decode engines (pd-prefill, pd-decode, -1, ...)."""
    store = CacheStoreProcess(tmp / "cachestore.log", free_port(), "--memory", "512MiB").wait_serving()
    router = cluster.router(
        "--heartbeat-interval-ms", str(heartbeat_ms), "--disagg-min-prompt-tokens", "64", *router_flags
    )  # fmt: skip
    flags = [*ENGINE_FLAGS, "--cachestore", store.address]
    decoders = engines if decoders is None else decoders
    names = [""] + [f"-{i}" for i in range(1, max(engines, decoders))]
    prefill = cluster.real_engines(router, engines, *flags, "--role", "prefill", ids=[f"pd-prefill{n}" for n in names])
    ids = [f"pd-decode{n}" for n in names[:decoders]]
    decode = cluster.real_engines(router, decoders, *flags, "--role", "decode", ids=ids)
    for engine in (*prefill, *decode):
        cluster.wait_registered(engine)
    return PD(router, prefill[0], decode[0], store, prefill[1:], decode[1:])


@pytest.fixture(scope="module")
def pd(tmp_path_factory, model_dir):
    tmp = tmp_path_factory.mktemp("pd")
    cluster = Cluster(tmp, model_dir)
    fleet = start_pd(cluster, tmp)
    reference = cluster.real_engines(None, 1, *ENGINE_FLAGS, ids=["pd-both"])[0]
    ready = lambda: httpx.get(reference.url + "/ready", timeout=5).status_code == 200  # noqa: E731
    until(ready, timeout=300, what="the reference engine ready", proc=reference)
    yield fleet, reference
    cluster.stop_all()
    fleet.store.stop()


def metric(url: str, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in scrape(url).items() if n == name and all((k, v) in ls for k, v in labels.items()))


def rag(i: int, question: str, **extra) -> dict:
    messages = [{"role": "system", "content": f"Answer from the context.\n\n{case_file(i)}"}]
    return {"model": "tiny", "messages": [*messages, {"role": "user", "content": question}], **extra}


SHORT = {"model": "tiny", "messages": [{"role": "user", "content": "Name a colour."}]}
MULTI_TURN = rag(2, "Which item weighs 13 grams?") | {"messages": [
    *rag(2, "Which item weighs 13 grams?")["messages"],
    {"role": "assistant", "content": "Item 2-1 weighs 13 grams."},
    {"role": "user", "content": "And which weighs 26 grams?"},
]}  # fmt: skip
PROMPTS = {"short": SHORT, "rag_2k": rag(1, "Which item weighs 39 grams?"), "multi_turn": MULTI_TURN}


def answer(url: str, body: dict) -> tuple[list[str], dict, httpx.Headers]:
    """(each choice's text by index, usage, headers), streamed or not."""
    if not body.get("stream"):
        resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
        assert resp.status_code == 200, resp.text
        data = resp.json()
        return (
            [c["message"]["content"] for c in sorted(data["choices"], key=lambda c: c["index"])],
            data["usage"],
            (resp.headers),
        )
    texts: dict[int, str] = {}
    usage, ids = {}, set()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            ids.add(chunk["id"])
            usage = chunk.get("usage") or usage
            for c in chunk["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + (c["delta"].get("content") or "")
        headers = resp.headers
    assert len(ids) == 1, ids  # one response
    return [texts[i] for i in sorted(texts)], usage, headers


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("name", list(PROMPTS))
def test_1p1d_equals_one_engine(pd, name, stream, n):
    fleet, reference = pd
    body = PROMPTS[name] | {"max_tokens": 12, "temperature": 0, "n": n, "stream": stream, "ignore_eos": True}
    if stream:
        body["stream_options"] = {"include_usage": True}
    legs = metric(fleet.router.url, LEGS, outcome="ok")
    texts, usage, headers = answer(fleet.router.url, body)
    expected, ref_usage, _ = answer(reference.url, body)
    assert texts == expected and len(texts) == n
    assert headers["x-ragserve-engine"] == "pd-decode"
    assert usage["prompt_tokens"] == ref_usage["prompt_tokens"]
    long = usage["prompt_tokens"] >= 64
    assert metric(fleet.router.url, LEGS, outcome="ok") == legs + long  # short prompts skip the prefill leg
    if long:  # fetched (or held since): every prompt token, or all but the last one with n > 1 (computed again)
        assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - (n > 1)


def test_ttft_split_into_prefill_and_decode_legs(pd):
    fleet, _ = pd
    url, ttft, decode = fleet.router.url, "ragserve_router_time_to_first_token_seconds", DECODE_TTFT
    before = {k: metric(url, k) for k in (f"{ttft}_sum", f"{decode}_count", f"{decode}_sum", f"{LEG_S}_sum")}
    answer(url, rag(3, "Which item weighs 39 grams?", max_tokens=4, stream=True))
    delta = {k: metric(url, k) - v for k, v in before.items()}
    assert delta[f"{decode}_count"] == 1
    # the request's TTFT is its prefill leg plus its decode leg
    assert delta[f"{decode}_sum"] + delta[f"{LEG_S}_sum"] == pytest.approx(delta[f"{ttft}_sum"])
    answer(url, SHORT | {"max_tokens": 4, "stream": True})  # no prefill leg: no decode-leg TTFT either
    assert metric(url, f"{decode}_count") == before[f"{decode}_count"] + 1


def test_decode_engine_fetched_the_prompt(pd):
    fleet, _ = pd
    body = rag(7, "What does item 7-3 weigh?", max_tokens=4, temperature=0)
    before = metric(fleet.decode.url, FETCHED)
    _, usage, _ = answer(fleet.router.url, body)
    assert metric(fleet.decode.url, FETCHED) - before == usage["prompt_tokens"]


def transfer(url: str, what: str, direction: str) -> float:
    return metric(url, f"ragserve:kv_transfer_{what}_total", direction=direction)


TAILED = [
    rag(4, q, max_tokens=2, cache_salt="moved")
    for q in ("Name the heaviest item.", "List two items.", "Which item weighs 26 grams?")
]


def test_engines_count_the_kv_they_moved(pd, model_dir):
    """The prefill engine's stored bytes and the decode engine's fetched bytes are the prompt's blocks: its cacheable
    blocks and the tail block, each block_nbytes (the tiny model's float32 KV); one request each side."""
    fleet, reference = pd
    config = json.loads((model_dir / "config.json").read_text())
    block_nbytes = config["num_hidden_layers"] * 2 * 16 * config["num_key_value_heads"] * config["head_dim"] * 4
    before = {(e.url, w, d): transfer(e.url, w, d) for e in (fleet.prefill, fleet.decode) for w in
              ("bytes", "seconds", "requests") for d in ("stored", "fetched")}  # fmt: skip
    n, body = next(  # a prompt with a tail (2 to 15 tokens after its cacheable blocks, its last token included)
        (n, b) for n, b in ((answer(reference.url, b)[1]["prompt_tokens"], b) for b in TAILED) if n % 16 not in (0, 1)
    )
    _, usage, _ = answer(fleet.router.url, body)
    moved = {k: transfer(*k) - v for k, v in before.items()}
    assert usage["prompt_tokens"] == n and usage["prompt_tokens_details"]["cached_tokens"] == n
    blocks = n // 16 + 1  # cacheable blocks + the tail block
    assert moved[fleet.prefill.url, "bytes", "stored"] == blocks * block_nbytes
    assert moved[fleet.prefill.url, "requests", "stored"] == 1
    assert moved[fleet.decode.url, "bytes", "fetched"] == blocks * block_nbytes
    assert moved[fleet.decode.url, "requests", "fetched"] == 1
    assert moved[fleet.prefill.url, "seconds", "stored"] > 0 and moved[fleet.decode.url, "seconds", "fetched"] > 0
    assert moved[fleet.prefill.url, "bytes", "fetched"] == 0  # nothing of it was in the store before


def prompt_tokens(engine: Server) -> float:
    return metric(engine.url, "vllm:prompt_tokens_total")


def in_flight(router: Server, n: int, until) -> None:
    until(lambda: metric(router.url, "ragserve_router_requests_in_flight") >= n, timeout=60, message="in flight")


def leg_killed(fleet: PD, victim: Server, body: dict, until) -> list:
    """`body` streamed through the router while `victim` (a prefill engine) hangs with the leg, then SIGKILLed."""
    results: list = []
    with frozen([victim]):  # the prefill leg is sent and hangs there: mid-prefill
        worker = threading.Thread(target=lambda: results.append(answer(fleet.router.url, body | {"stream": True})))
        worker.start()
        in_flight(fleet.router, 2, until)
        victim.popen.send_signal(signal.SIGKILL)
    worker.join(timeout=300)
    return results


def legs(router: Server) -> dict[str, float]:
    return {o: metric(router.url, LEGS, outcome=o) for o in ("ok", "retried", "failed")}


def test_faults_lose_no_request(tmp_path, model_dir, until):
    """One 2P2D fleet (the router's heartbeat slow: a dead engine stays in its pool), faults in turn, each answer the
    healthy one: a decode engine SIGKILLed mid-stream (migrated to the other); the prefill engine with the leg
    killed mid-prefill (the leg retried on the other); the store stopped (the decode engine computes); the last
    prefill engine killed mid-prefill (none left: the decode engine computes)."""
    cluster = Cluster(tmp_path, model_dir)
    fleet = start_pd(cluster, tmp_path, 10_000, 2, None, *SESSION)
    prefills, decodes = [fleet.prefill, *fleet.more_prefill], [fleet.decode, *fleet.more_decode]
    try:
        body = rag(9, "Which item is heaviest?", max_tokens=8, temperature=0, user="fault-test")
        expected, *_ = answer(fleet.router.url, body)
        first = max(prefills, key=prompt_tokens)  # the leg's engine: its `user` ranks it first again (SESSION)

        long = rag(6, "Tell a long story.", max_tokens=400, temperature=0, ignore_eos=True, cache_salt="long")
        story, *_ = answer(fleet.router.url, long)
        migrated = metric(fleet.router.url, "ragserve_router_migrations_total")
        results: list = []
        with httpx.stream("POST", fleet.router.url + "/v1/chat/completions", json=long | {"stream": True},
                          timeout=300) as resp:  # fmt: skip
            victim = next(e for e in decodes if e.name == resp.headers["x-ragserve-engine"])
            text = ""
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk  # the stream broke off
                    text += "".join(c["delta"].get("content") or "" for c in chunk["choices"])
                    if text and victim.alive():  # mid-stream: hundreds of tokens still to come
                        victim.popen.send_signal(signal.SIGKILL)
                        victim.popen.wait()
                    results.append(chunk["id"])
        assert text == story[0] and len(set(results)) == 1  # one response, the whole story
        assert metric(fleet.router.url, "ragserve_router_migrations_total") == migrated + 1

        before, others = legs(fleet.router), [e for e in prefills if e is not first]
        computed = {e.name: prompt_tokens(e) for e in others}
        results = leg_killed(fleet, first, body, until)
        assert results and results[0][0] == expected
        after = legs(fleet.router)
        assert after["retried"] == before["retried"] + 1 and after["ok"] == before["ok"] + 1
        assert after["failed"] == before["failed"]
        assert any(prompt_tokens(e) > computed[e.name] for e in others)  # the retry computed the prompt

        fleet.store.stop()
        texts, usage, _ = answer(fleet.router.url, body | {"cache_salt": "store-down"})
        assert texts == expected
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0  # computed on the decode engine

        failed = legs(fleet.router)["failed"]
        results = leg_killed(fleet, others[0], body | {"cache_salt": "no-prefill"}, until)
        assert results and results[0][0] == expected
        assert legs(fleet.router)["failed"] == failed + 1  # no prefill engine left: the decode engine computed
    finally:
        cluster.stop_all()
        fleet.store.stop()


def leg_refused(fleet: PD, victim: Server, body: dict, until) -> tuple[list[str], dict]:
    """`body` through the router while `victim` (a prefill engine) is draining: frozen while the router sends it the
    leg (it is still registered then), SIGTERMed and thawed, it answers the leg 503 (a request of its own keeps it
    up), then exits."""
    results: list = []
    with running(victim):
        with frozen([victim]):
            worker = threading.Thread(target=lambda: results.append(answer(fleet.router.url, body)))
            worker.start()
            in_flight(fleet.router, 2, until)
            victim.popen.send_signal(signal.SIGTERM)
        worker.join(timeout=300)
    victim.popen.wait(60)
    assert results, "no answer"
    texts, usage, _ = results[0]
    return texts, usage


def server_errors(router: Server, engine: Server) -> float:
    return metric(router.url, "ragserve_router_engine_errors_total", engine=engine.name, kind="server_error")


def test_prefill_engine_answering_5xx_loses_no_request(pd, tmp_path, model_dir, until):
    """A live prefill engine answering 5xx (draining: 503) fails the leg: it is retried on the other prefill engine;
    with none left, the decode engine computes the prompt. Each answer the `both` engine's, token for token."""
    _, reference = pd
    cluster = Cluster(tmp_path, model_dir)
    fleet = start_pd(cluster, tmp_path, 10_000, 2, 1, *SESSION)
    prefills = [fleet.prefill, *fleet.more_prefill]
    try:
        body = rag(10, "Which item weighs 52 grams?", max_tokens=8, temperature=0, ignore_eos=True, user="fault-test")
        expected, _, _ = answer(reference.url, body)
        answer(fleet.router.url, body | {"cache_salt": "warm"})
        first = max(prefills, key=prompt_tokens)  # the leg's engine: its `user` ranks it first again (SESSION)
        (other,) = [e for e in prefills if e is not first]
        before, computed = legs(fleet.router), prompt_tokens(other)
        texts, usage = leg_refused(fleet, first, body | {"cache_salt": "warm"}, until)
        assert texts == expected
        assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"]  # the retry's KV
        after = legs(fleet.router)
        assert after == before | {"retried": before["retried"] + 1, "ok": before["ok"] + 1}
        assert server_errors(fleet.router, first) == 1  # a 5xx, not a refused connection
        assert prompt_tokens(other) > computed  # the retry ran there

        texts, usage = leg_refused(fleet, other, body | {"cache_salt": "none-left"}, until)
        assert texts == expected
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0  # computed on the decode engine
        assert legs(fleet.router)["failed"] == after["failed"] + 1
        assert server_errors(fleet.router, other) == 1
    finally:
        cluster.stop_all()
        fleet.store.stop()
