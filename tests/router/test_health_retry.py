"""Health-check thresholds (a real router probing a stand-in engine whose probe answers are scripted: a real engine
cannot fail its probes on demand) and retry backoff with jitter."""

from __future__ import annotations

import random
import signal

import httpx

from ragserve.router_args import RouterConfig
from ragserve_router.retry import backoff
from tests.router.test_reliability import chat, post, ready


def probes(engine) -> dict:
    return httpx.get(engine.url + "/control/stats", timeout=5).json()


def script(engine, statuses: list[int]) -> int:
    """The next probes answer `statuses`; returns the probe count they start after."""
    start = probes(engine)["probes"]
    httpx.post(engine.url + "/control/probes", json={"script": statuses}, timeout=5).raise_for_status()
    return start


def test_health_thresholds_count_probes_in_a_row(cluster, metrics, until):
    engine = cluster.engine("eng-flaky")
    flags = "--probe-interval 0.05 --health-failure-threshold 3 --health-success-threshold 2"
    router = cluster.router("--static-engines", engine.url, *flags.split())
    until(lambda: ready(router)["healthy_engines"] == 1, message="engine probed healthy")

    def transitions(state: str) -> float:
        return metrics(router.url, "ragserve_router_engine_health_transitions_total", engine="static-0", state=state)

    assert (transitions("healthy"), transitions("unhealthy")) == (1, 0)
    # two failed probes, then passes: below the failure threshold, the engine never leaves
    start = script(engine, [503, 503])
    until(lambda: probes(engine)["probes"] >= start + 3, message="two failed probes judged")  # one per engine at once
    assert transitions("unhealthy") == 0 and ready(router)["healthy_engines"] == 1
    # three failed: unhealthy; one pass is not enough to come back, the two after the next failure are
    script(engine, [503, 503, 503, 200, 503])
    until(lambda: transitions("unhealthy") == 1, message="three failed probes take it out")
    until(lambda: ready(router)["healthy_engines"] == 1, message="two passed probes bring it back")
    assert (transitions("healthy"), transitions("unhealthy")) == (2, 1)
    assert post(router, chat()).status_code == 200


def test_a_failed_connection_takes_an_engine_out_until_the_success_threshold(cluster, metrics, until):
    """A request that cannot connect takes the engine out at once (not after --health-failure-threshold probes)."""
    a, b = cluster.engine("eng-a"), cluster.engine("eng-b")
    flags = f"--static-engines {a.url},{b.url} --policy round_robin --probe-interval 0.05"
    router = cluster.router(*flags.split(), "--health-failure-threshold", "1000", "--health-success-threshold", "3")
    until(lambda: ready(router)["healthy_engines"] == 2, message="both engines probed")
    port = a.port
    a.stop(signal.SIGKILL)
    assert [post(router, chat(f"q{i}")).status_code for i in range(2)] == [200, 200]
    assert ready(router)["healthy_engines"] == 1
    cluster.engine("eng-a-again", port=port)
    until(lambda: ready(router)["healthy_engines"] == 2, message="probed back")


def test_retry_backoff_doubles_is_capped_and_jittered():
    cfg = RouterConfig(retry_backoff=0.1, retry_backoff_max=0.5, retry_jitter=0.0)
    assert [backoff(cfg, n) for n in (1, 2, 3, 4, 5)] == [0.1, 0.2, 0.4, 0.5, 0.5]
    cfg = RouterConfig(retry_backoff=0.1, retry_backoff_max=0.5, retry_jitter=0.5)
    rng = random.Random(7)
    delays = [backoff(cfg, 2, rng) for _ in range(200)]
    assert all(0.1 <= d <= 0.2 for d in delays)
    assert len(set(delays)) == 200 and min(delays) < 0.11 and max(delays) > 0.19  # spread over the whole range
    full = RouterConfig(retry_backoff=0.1, retry_jitter=1.0)
    assert min(backoff(full, 1, rng) for _ in range(200)) < 0.01


def test_bad_retry_and_health_flags_are_refused():
    for bad in ({"retry_jitter": 1.5}, {"retry_backoff_max": -1.0}):
        try:
            RouterConfig(**bad)
        except ValueError as exc:
            assert "--retry" in str(exc)
        else:
            raise AssertionError(bad)
