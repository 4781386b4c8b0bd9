"""Redis is a cache of the router's state, not its owner: a restart without persistence (as the chart and
`ragserve up` run it) under load costs no request, and the router publishes its engines again."""

from __future__ import annotations

import shutil
import signal

import httpx
import redis

from ragserve.stack import health
from ragserve.stack.spec import redis_spec
from tests.helpers.net import free_port
from tests.helpers.process import start
from tests.reliability.conftest import ready, start_engines, under_load


def test_redis_restart_under_load_costs_no_request(cluster, metrics, until, tmp_path):
    (tmp_path / "redis").mkdir()
    spec = redis_spec(shutil.which("redis-server"), free_port(), str(tmp_path / "redis"), "warning")

    def start_redis():
        proc = start("redis", spec.argv, tmp_path / "redis.log")
        until(lambda: health.check(spec.probe), message="redis PING")
        return proc

    server = start_redis()
    router = cluster.router("--redis", spec.url, "--heartbeat-interval-ms", "300")
    start_engines(cluster, router, ["rr-a", "rr-b"], "--max-model-len", "256")
    until(lambda: ready(router)["engines"] == 2, timeout=60, message="two engines registered")
    store = redis.Redis.from_url(spec.url)

    def indexed() -> int:
        return store.scard("ragserve:blocks:rr-a") + store.scard("ragserve:blocks:rr-b")

    # full KV blocks on an engine (the load's prompts are shorter than a block), so the index has entries
    long_prompt = {"model": "tiny", "prompt": "the cached context " * 30, "max_tokens": 2}
    assert httpx.post(router.url + "/v1/completions", json=long_prompt, timeout=60).status_code == 200
    until(lambda: indexed() > 0, message="KV index before the restart")

    def call(i: int, n: int) -> int:
        stream = n % 2 == 0
        body = {"model": "tiny", "prompt": f"client {i} asks {n}", "max_tokens": 4, "stream": stream}
        resp = httpx.post(router.url + "/v1/completions", json=body, timeout=60)
        ended = not stream or resp.text.rstrip().endswith("data: [DONE]")
        return resp.status_code if ended else -1

    def restart() -> None:
        nonlocal server
        server.stop(signal.SIGKILL)
        server = start_redis()
        until(lambda: store.hlen("ragserve:engines") == 2, message="the router published its engines again")

    codes = under_load(call, 4, restart, warmup=20, after=20)
    assert codes and set(codes) == {200}, sorted(set(codes))
    assert ready(router)["engines"] == 2
    # the engines were asked to register again, so their KV blocks are back in the index
    until(lambda: metrics(router.url, "ragserve_router_registrations_total") >= 4, message="engines re-registered")
    until(lambda: indexed() > 0, message="KV index rebuilt after the restart")
    server.stop()
