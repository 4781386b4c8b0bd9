"""Mid-stream migration: an engine SIGKILLed under load costs no request; where a stream cannot be resumed
it ends with an error event (no [DONE]), so the openai SDK raises instead of returning a truncated answer.

No race decides what is on the killed engine: every stream asks for MAX_TOKENS tokens (ignore_eos), the kill
comes only once each has streamed its first chunk, names its engine (x-ragserve-engine) and the victim's
running-requests gauge counts exactly its streams, so each of them is still generating when it dies.

One module fleet (a router with migration, one without, two real engines): a test that kills an engine
leaves it dead, and the next test restarts it (same id and port) before it starts.
"""

from __future__ import annotations

import json
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ragserve.metric_names import NUM_REQUESTS_RUNNING
from tests.helpers.process import until
from tests.reliability.conftest import Cluster, Server, ready, start_engines
from tests.router.conftest import scrape

PROMPTS = [f"Story {i}: once upon a time in a land of {word}" for i, word in enumerate(("rivers", "hills", "snow"))]
MAX_TOKENS = 400  # hundreds of decode steps after the kill decision: no stream can end before the kill
RESULTS = ("resumed", "completed", "resent", "no_engine", "limit", "refused", "sampling_without_seed", "disabled")


def body(prompt: str, **extra) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, **extra}  # fmt: skip


def running(engine: Server) -> int:
    """The engine's own vllm:num_requests_running."""
    text = httpx.get(engine.url + "/metrics", timeout=10).text
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == NUM_REQUESTS_RUNNING]
    assert len(samples) == 1, samples
    return int(samples[0].value)


def migrations(router: Server) -> dict[str, float]:
    """ragserve_router_migrations_total by outcome."""
    samples = scrape(router.url).items()
    return {dict(labels)["outcome"]: v for (name, labels), v in samples if name.endswith("migrations_total")}


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in RESULTS if after.get(k, 0) != before.get(k, 0)}


@dataclass
class Fleet:
    cluster: Cluster
    router: Server  # least_loaded, migration on
    no_migration: Server  # --migration-limit 0, the same two engines as --static-engines (static-0, static-1)
    engines: list[Server]

    def revive(self) -> None:
        """Restart any engine an earlier test killed (same argv: id and port), until both routers route to both."""
        for i, engine in enumerate(self.engines):
            if not engine.alive():
                self.engines[i] = self.cluster._spawn(engine.name, list(engine.popen.args), engine.port)
        for engine in self.engines:
            self.cluster.wait_http(engine, timeout=300)
        for router in (self.router, self.no_migration):
            until(lambda r=router: ready(r)["healthy_engines"] == 2, timeout=60, what=f"{router.name}: 2 engines")
        for engine in self.engines:
            until(lambda e=engine: running(e) == 0, timeout=30, what=f"{engine.name} idle")

    def serving(self, router: Server, header: str) -> Server:
        """The engine a router's x-ragserve-engine names."""
        if router is self.no_migration:
            return self.engines[int(header.removeprefix("static-"))]
        return next(e for e in self.engines if e.name == header)


@pytest.fixture(scope="module")
def module_fleet(tmp_path_factory, model_dir):
    cluster = Cluster(tmp_path_factory.mktemp("migration"), model_dir)
    try:
        router = cluster.router("--heartbeat-interval-ms", "300", "--policy", "least_loaded", "--probe-interval", "0.3")
        flags = ("--max-model-len", "512", "--num-gpu-blocks", "256")
        engines = start_engines(cluster, router, ["mig-a", "mig-b"], *flags)
        static = ",".join(e.url for e in engines)
        argv = ["--migration-limit", "0", "--static-engines", static, "--probe-interval", "0.3"]
        no_migration = cluster.router(*argv, name="router-no-migration")
        yield Fleet(cluster, router, no_migration, engines)
    finally:
        cluster.stop_all()


@pytest.fixture
def fleet(module_fleet):
    module_fleet.revive()
    return module_fleet


class Reader:
    """One streamed completion through the router: its engine, text, usage and how it ended."""

    def __init__(self, router_url: str, request: dict) -> None:
        self.url, self.request = router_url, request
        self.engine, self.text, self.usage, self.chunks, self.ids = "", "", {}, 0, set()
        self.lines: list[str] = []
        self.first = threading.Event()  # the engine header is known and the first content chunk arrived

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
                    self.first.set()
        return self

    @property
    def done(self) -> bool:
        return self.lines[-1:] == ["[DONE]"]


def test_engine_sigkilled_mid_stream_under_load_costs_no_request(fleet):
    router = fleet.router
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # uninterrupted runs of the same greedy requests
        reference = dict(zip(PROMPTS, pool.map(lambda p: Reader(router.url, body(p)).run(), PROMPTS), strict=True))
    before = migrations(router)

    stop, go, plain_in_flight = threading.Event(), threading.Event(), [0]
    lock = threading.Lock()

    def plain(i: int) -> list[int]:  # non-streamed load alongside, held back while the victim is counted
        codes = []
        while not stop.is_set():
            with lock:  # admitted only while go is set; go is cleared under the same lock
                admitted = go.is_set()
                plain_in_flight[0] += admitted
            if not admitted:
                go.wait()
                continue
            request = {**body(f"plain {i} {len(codes)}"), "stream": False, "max_tokens": 24}
            request.pop("stream_options")
            try:
                codes.append(httpx.post(router.url + "/v1/completions", json=request, timeout=120).status_code)
            finally:
                with lock:
                    plain_in_flight[0] -= 1
        return codes

    readers = [Reader(router.url, body(p)) for p in PROMPTS * 2]
    with ThreadPoolExecutor(len(readers) + 2) as pool:
        go.set()
        plain_load = [pool.submit(plain, i) for i in range(2)]
        streams = [pool.submit(r.run) for r in readers]
        try:
            until(lambda: all(r.first.is_set() for r in readers) or any(s.done() for s in streams), what="streams")
            assert all(r.first.is_set() for r in readers), [s.result() for s in streams if s.done()]
            with lock:
                go.clear()  # no plain request starts now: once those running end, the gauges count streams only
            until(lambda: plain_in_flight[0] == 0, timeout=60, what="plain requests drained")
            victim = fleet.serving(router, readers[0].engine)
            survivor = next(e for e in fleet.engines if e is not victim)
            on_victim = [r for r in readers if r.engine == victim.name]
            until(lambda: running(victim) == len(on_victim), timeout=10, interval=0.02, what="victim's gauge")
            assert not any(r.done for r in readers) and running(survivor) == len(readers) - len(on_victim)
            victim.stop(signal.SIGKILL)
            go.set()  # the load goes on while the router notices and the streams move
            for s in streams:
                s.result()
        finally:
            stop.set()
            go.set()
        codes = [c for f in plain_load for c in f.result()]

    assert set(codes) <= {200} and codes
    for r in readers:
        want = reference[r.request["prompt"]]
        assert r.done
        assert r.text == want.text  # greedy: token for token what an uninterrupted run says
        assert len(r.ids) == 1  # one id and created for the whole stream: no seam
        assert r.usage["completion_tokens"] == MAX_TOKENS == want.usage["completion_tokens"]
        assert r.usage["prompt_tokens"] == want.usage["prompt_tokens"]
    moved = delta(migrations(router), before)
    assert moved.pop("resumed", 0) == len(on_victim)  # each stream on the victim moved once, no other did
    assert set(moved) <= {"resent"}, moved  # plain requests cut by the kill were sent again; nothing failed


@pytest.mark.parametrize("without_migration, sampling", [(False, {"temperature": 1.0}), (True, {"temperature": 0})])
def test_a_stream_that_cannot_move_ends_with_an_error_the_sdk_raises(fleet, without_migration, sampling):
    """Sampling without a seed (or migration off): the stream is cut with an error event, never a clean end."""
    router = fleet.no_migration if without_migration else fleet.router
    before = migrations(router)
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
    stream = client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, stream=True, extra_body={"ignore_eos": True}, **sampling
    )
    serving = fleet.serving(router, stream.response.headers["x-ragserve-engine"])
    chunks = iter(stream)
    assert next(chunks).choices[0].text is not None
    until(lambda: running(serving) == 1, timeout=10, interval=0.02, what="the stream running on its engine")
    serving.stop(signal.SIGKILL)
    with pytest.raises(openai.APIError, match="could not be resumed"):
        for _ in chunks:
            pass
    outcome = "disabled" if without_migration else "sampling_without_seed"
    assert delta(migrations(router), before) == {outcome: 1}
