"""Retries before the first byte, circuit breakers (open, half-open probes, closed), probing back, drain.
(Engine death under load: test_e2e_engines, on real engines.)"""

from __future__ import annotations

import json
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx


def chat(text: str = "hello", **extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 2, **extra}


def post(router, body: dict, **kw) -> httpx.Response:
    return httpx.post(router.url + "/v1/chat/completions", json=body, timeout=60, **kw)


def ready(router) -> dict:
    return httpx.get(router.url + "/ready", timeout=5).json()


def test_dead_engine_is_retried_elsewhere_marked_unhealthy_and_probed_back(cluster, metrics, until):
    a, b = cluster.engine("eng-a"), cluster.engine("eng-b")
    # probes bring an engine back quickly but never take it out first: the dead engine is found by a request
    # (a probe landing between the kill and the first request had left nothing to retry: a CI flake)
    flags = f"--static-engines {a.url},{b.url} --policy round_robin --probe-interval 0.5 --health-failure-threshold 100"
    router = cluster.router(*flags.split())
    until(lambda: ready(router)["healthy_engines"] == 2, message="both engines probed")
    a_port = a.port
    a.stop(signal.SIGKILL)
    served = [post(router, chat(f"q{i}")) for i in range(4)]
    assert [r.status_code for r in served] == [200] * 4
    assert {r.headers["x-ragserve-engine"] for r in served} == {"static-1"}
    assert metrics(router.url, "ragserve_router_retries_total", reason="connect") >= 1
    assert metrics(router.url, "ragserve_router_engine_errors_total", engine="static-0", kind="connect") >= 1
    assert ready(router)["healthy_engines"] == 1
    cluster.engine("eng-a-again", port=a_port)  # same address: the probe brings static-0 back
    until(lambda: ready(router)["healthy_engines"] == 2, message="engine probed back to healthy")
    engines = {post(router, chat(f"r{i}")).headers["x-ragserve-engine"] for i in range(4)}
    assert engines == {"static-0", "static-1"}


def test_engine_5xx_is_retried_elsewhere_and_opens_its_breaker_not_its_health(cluster, metrics, until):
    """A 5xx not scoped to the request is retried on the next engine; --breaker-failures of them in a row open
    the engine's breaker, which keeps it out while its health (its /health answers) stays. With every engine
    failing the client gets a clean 502."""
    bad = cluster.engine("eng-bad", "--fail-status", "500")
    good = cluster.engine("eng-good")
    flags = f"--static-engines {bad.url},{good.url} --policy round_robin --breaker-failures 2 --probe-interval 30"
    router = cluster.router(*flags.split())
    until(lambda: ready(router)["healthy_engines"] == 2, message="both engines probed")
    results = [post(router, chat(f"q{i}")) for i in range(6)]
    assert all(r.status_code == 200 and r.headers["x-ragserve-engine"] == "static-1" for r in results)
    assert metrics(router.url, "ragserve_router_retries_total", reason="server_error") == 2  # then it was open
    assert metrics(router.url, "ragserve_router_breaker_state", engine="static-0") == 2
    assert ready(router)["healthy_engines"] == 2  # its /health answers: it stays healthy

    only_bad = cluster.engine("eng-bad-2", "--fail-status", "500")
    router = cluster.router("--static-engines", only_bad.url, "--max-attempts", "2", "--probe-interval", "30")
    until(lambda: ready(router)["healthy_engines"] == 1, message="engine probed")
    resp = post(router, chat())
    assert resp.status_code == 502
    error = resp.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "server_error"
    assert "127.0.0.1" not in resp.text and str(only_bad.port) not in resp.text and "injected" not in resp.text


def test_request_scoped_failures_are_passed_through_never_replayed_never_held_against_the_engine(
    cluster, metrics, until
):
    """Contract 1: a 4xx, or a 5xx the engine scopes to the request, is the client's answer as it is."""
    failing = [
        cluster.engine("eng-500", "--fail-status", "500", "--fail-scope", "request"),
        cluster.engine("eng-400", "--fail-status", "400"),
    ]
    good = cluster.engine("eng-good")
    urls = ",".join(e.url for e in [*failing, good])
    router = cluster.router("--static-engines", urls, "--policy", "round_robin", "--breaker-failures", "1")
    until(lambda: ready(router)["healthy_engines"] == 3, message="engines probed")
    codes = sorted(post(router, chat(f"q{i}")).status_code for i in range(30))
    assert codes == [200] * 10 + [400] * 10 + [500] * 10
    assert metrics.total(router.url, "ragserve_router_retries_total") == 0
    assert metrics.total(router.url, "ragserve_router_engine_errors_total") == 0
    assert ready(router)["healthy_engines"] == 3


def test_a_burst_is_spread_by_slots_reserved_at_decision_time(cluster, until):
    """16 simultaneous requests over 2 idle engines: each decision sees the ones before it. The prompts share
    their one full leading chunk (like a RAG template), so only the load tells the engines apart."""
    engines = [cluster.engine(f"eng-{i}") for i in range(2)]
    for engine in engines:
        httpx.post(engine.url + "/control/hold")
    # prefix: one leading chunk, one ring position; only the bound on load (slots included) spreads them
    router = cluster.router("--static-engines", ",".join(e.url for e in engines), "--policy", "prefix")
    until(lambda: ready(router)["healthy_engines"] == 2, message="engines probed")

    def one(i: int) -> str:
        body = chat("You answer from the retrieved passages only, citing each. " + f"Question {i}?", stream=True)
        with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=60) as resp:
            for _ in resp.iter_lines():
                pass
            return resp.headers["x-ragserve-engine"]

    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(one, i) for i in range(16)]
        stats = [lambda e=e: httpx.get(e.url + "/control/stats").json()["running"] for e in engines]
        until(lambda: sum(s() for s in stats) == 16, message="16 streams held")
        for engine in engines:
            httpx.post(engine.url + "/control/release")
        served = [f.result() for f in futures]
    split = sorted(served.count(name) for name in ("static-0", "static-1"))
    assert split[0] >= 6, f"burst split {split}"


def test_sigterm_drains_in_flight_streams(cluster, until):
    engine = cluster.engine("eng-drain")
    router = cluster.router("--static-engines", engine.url, "--drain-delay", "1")
    until(lambda: ready(router)["healthy_engines"] == 1, message="engine probed")
    httpx.post(engine.url + "/control/hold")
    lines: list[str] = []
    with httpx.stream("POST", router.url + "/v1/chat/completions", json=chat(stream=True), timeout=60) as resp:
        it = resp.iter_lines()
        lines.append(next(line for line in it if line))
        router.popen.send_signal(signal.SIGTERM)
        drain = until(lambda: httpx.get(router.url + "/ready").status_code == 503, message="not ready while draining")
        assert drain
        httpx.post(engine.url + "/control/release")
        lines += [line for line in it if line]
    assert lines[-1] == "data: [DONE]" and json.loads(lines[0][6:])["choices"][0]["delta"]["content"] == "ok"
    assert router.popen.wait(20) == 0


def received(engine) -> int:
    return httpx.get(engine.url + "/control/stats", timeout=5).json()["received"]


def test_a_failing_engines_breaker_opens_gets_no_request_while_open_and_closes_through_a_probe(cluster, metrics, until):
    bad, good = cluster.engine("brk-bad", "--fail-status", "500"), cluster.engine("brk-good")
    flags = f"--static-engines {bad.url},{good.url} --policy round_robin --breaker-failures 3 --breaker-cooldown 2"
    router = cluster.router(*flags.split(), "--probe-interval", "30")
    until(lambda: ready(router)["healthy_engines"] == 2, message="both engines probed")

    def state() -> float:
        return metrics(router.url, "ragserve_router_breaker_state", engine="static-0")

    def transitions(to: str) -> float:
        return metrics(router.url, "ragserve_router_breaker_transitions_total", engine="static-0", state=to)

    served = [post(router, chat(f"q{i}")) for i in range(20)]
    assert all(r.status_code == 200 and r.headers["x-ragserve-engine"] == "static-1" for r in served)
    assert transitions("open") >= 1
    # while open it got nothing: past its 3 failures, only half-open probes, one per reopening
    assert received(bad) == 3 + transitions("open") - 1
    assert transitions("half_open") >= transitions("open") - 1
    assert ready(router)["healthy_engines"] == 2  # open breaker, healthy engine: separate

    httpx.post(bad.url + "/control/fail", json={"status": 0}, timeout=5)  # the engine recovers
    until(lambda: post(router, chat("probe?")).status_code == 200 and state() == 0, timeout=30,
          message="breaker closed by a probe")  # fmt: skip
    assert transitions("closed") == 1
    before = received(bad)
    engines = [post(router, chat(f"after {i}")).headers["x-ragserve-engine"] for i in range(4)]
    assert set(engines) == {"static-0", "static-1"} and received(bad) == before + 2
