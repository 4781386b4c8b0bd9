"""Mid-stream migration: an engine SIGKILLed under load costs no request; where a stream cannot be resumed
it ends with an error event (no [DONE]), so the openai SDK raises instead of returning a truncated answer."""

from __future__ import annotations

import json
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.reliability.conftest import ready, start_engines

PROMPTS = [f"Story {i}: once upon a time in a land of {word}" for i, word in enumerate(("rivers", "hills", "snow"))]
MAX_TOKENS = 160


def body(prompt: str, **extra) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, **extra}  # fmt: skip


class Reader:
    """One streamed completion through the router: its engine, text, usage and how it ended."""

    def __init__(self, router_url: str, request: dict) -> None:
        self.url, self.request = router_url, request
        self.engine, self.text, self.usage, self.chunks, self.ids = "", "", {}, 0, set()
        self.lines: list[str] = []
        self.started = threading.Event()

    def run(self) -> Reader:
        with httpx.stream("POST", self.url + "/v1/completions", json=self.request, timeout=120) as resp:
            assert resp.status_code == 200, resp.read()
            self.engine = resp.headers["x-ragserve-engine"]
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                self.lines.append(line[6:])
                if line[6:] == "[DONE]":
                    break
                data = json.loads(line[6:])
                assert "error" not in data, data
                self.ids.add((data["id"], data["created"]))
                self.usage = data.get("usage") or self.usage
                for choice in data["choices"]:
                    assert "token_ids" not in choice  # the router asked for them, the client did not
                    self.text += choice["text"]
                    self.chunks += 1
                if self.chunks >= 4:
                    self.started.set()
        return self


def test_engine_sigkilled_mid_stream_under_load_costs_no_request(cluster, metrics, until):
    router = cluster.router("--heartbeat-interval-ms", "300", "--policy", "least_loaded")
    engines = start_engines(cluster, router, ["mig-a", "mig-b"], "--max-model-len", "512")
    until(lambda: ready(router)["healthy_engines"] == 2, timeout=60, message="two engines registered")
    reference = {p: Reader(router.url, body(p)).run() for p in PROMPTS}

    stop = threading.Event()

    def plain(i: int) -> list[int]:  # non-streamed load alongside
        codes = []
        while not stop.is_set():
            request = {**body(f"plain {i} {len(codes)}"), "stream": False, "max_tokens": 24}
            request.pop("stream_options")
            codes.append(httpx.post(router.url + "/v1/completions", json=request, timeout=120).status_code)
        return codes

    readers = [Reader(router.url, body(p)) for p in PROMPTS * 2]
    with ThreadPoolExecutor(len(readers) + 2) as pool:
        plain_load = [pool.submit(plain, i) for i in range(2)]
        streams = [pool.submit(r.run) for r in readers]
        pairs = list(zip(readers, streams, strict=True))
        until(lambda: all(r.started.is_set() or not s.running() for r, s in pairs), timeout=60, message="streams")
        on_victim = [r for r in readers if r.engine == "mig-a" and r.lines[-1:] != ["[DONE]"]]
        engines[0].stop(signal.SIGKILL)
        try:
            for s in streams:
                s.result()
        finally:
            stop.set()
        codes = [c for f in plain_load for c in f.result()]

    assert on_victim, "no stream was open on the killed engine"
    assert set(codes) <= {200} and codes
    for r in readers:
        want = reference[r.request["prompt"]]
        assert r.lines[-1] == "[DONE]"
        assert r.text == want.text  # greedy: token for token what an uninterrupted run says
        assert len(r.ids) == 1  # one id and created for the whole stream: no seam
        assert r.usage["completion_tokens"] == MAX_TOKENS == want.usage["completion_tokens"]
        assert r.usage["prompt_tokens"] == want.usage["prompt_tokens"]
    assert metrics(router.url, "ragserve_router_migrations_total", outcome="resumed") >= len(on_victim)


@pytest.mark.parametrize("flags, extra", [((), {"temperature": 1.0}), (("--migration-limit", "0"), {})])
def test_a_stream_that_cannot_move_ends_with_an_error_the_sdk_raises(cluster, metrics, until, flags, extra):
    """Sampling without a seed (or migration off): the stream is cut with an error event, never a clean end."""
    router = cluster.router("--heartbeat-interval-ms", "300", *flags)
    engines = start_engines(cluster, router, ["cut-a", "cut-b"], "--max-model-len", "512")
    until(lambda: ready(router)["healthy_engines"] == 2, timeout=60, message="two engines registered")
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
    sampling = {"temperature": 0, **extra}
    stream = client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, stream=True, extra_body={"ignore_eos": True}, **sampling
    )
    serving = stream.response.headers["x-ragserve-engine"]
    first = next(iter(stream))
    assert first.choices[0].text is not None
    next(e for e in engines if e.name == serving).stop(signal.SIGKILL)
    with pytest.raises(openai.APIError, match="could not be resumed"):
        for _ in stream:
            pass
    outcome = "sampling_without_seed" if extra else "disabled"
    assert metrics(router.url, "ragserve_router_migrations_total", outcome=outcome) == 1
