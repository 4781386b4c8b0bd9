"""Flow control with a real router and a real engine: places kept for critical requests
(--critical-reserve-per-engine) and a tenant's fair share of places (--tenant-fair-share). Built, not timed: the
engine frozen (SIGSTOP) while the situation is set up."""

from __future__ import annotations

from tests.helpers.process import frozen
from tests.reliability.conftest import ready, start_engines
from tests.router.test_flow_control import DEPTH, IN_FLIGHT, Holder, Queue, completion

CRITICAL = {"X-Ragserve-Priority": "1"}


def test_a_critical_request_takes_a_reserved_place_at_once_while_standard_ones_wait(cluster, metrics, until):
    router = cluster.router("--max-inflight-per-engine", "2", "--critical-reserve-per-engine", "1",
                            "--heartbeat-interval-ms", "5000")  # fmt: skip
    (engine,) = start_engines(cluster, router, ["reserve-0"], "--max-model-len", "1024")
    until(lambda: ready(router)["healthy_engines"] == 1, timeout=120, message="engine registered")
    queue = Queue(router.url, metrics, until)
    with frozen([engine]):
        holder = Holder(router.url, metrics, until)  # a standard request: the one place standard traffic has
        queue.send("standard", completion("standard waits"), {})
        queue.send("critical", completion("critical goes"), CRITICAL, queued=False)
        until(lambda: metrics(router.url, IN_FLIGHT) == 2, message="the critical request admitted to the reserve")
        assert metrics(router.url, DEPTH, **{"class": "critical"}) == 0
        assert metrics(router.url, DEPTH, **{"class": "standard"}) == 1
        queue.send("critical-2", completion("critical waits for a place"), CRITICAL)  # both places taken now
        holder.release()  # one place frees: the reserve keeps it from the standard request
        until(lambda: metrics(router.url, DEPTH, **{"class": "critical"}) == 0, message="critical-2 admitted")
        assert metrics(router.url, DEPTH, **{"class": "standard"}) == 1
    for name in queue.futures:
        assert queue.result(name).status_code == 200, queue.result(name).text
    assert queue.done[-1] == "standard"
    assert queue.depth() == 0


def test_a_heavy_tenant_holds_its_share_of_the_places_and_a_light_tenant_finds_one(cluster, metrics, until):
    """--tenant-fair-share, 4 places: with the light tenant active the heavy one holds at most 2, so its third
    request waits though a place is free, and the light tenant's next request takes that place at once."""
    router = cluster.router("--max-inflight-per-engine", "4", "--tenant-fair-share", "--tenant-header", "X-Tenant",
                            "--heartbeat-interval-ms", "5000")  # fmt: skip
    (engine,) = start_engines(cluster, router, ["share-0"], "--max-model-len", "1024")
    until(lambda: ready(router)["healthy_engines"] == 1, timeout=120, message="engine registered")
    heavy, light = {"X-Tenant": "heavy"}, {"X-Tenant": "light"}
    queue = Queue(router.url, metrics, until)
    with frozen([engine]):
        holder = Holder(router.url, metrics, until, light)
        for i, in_flight in ((0, 2), (1, 3)):
            queue.send(f"heavy-{i}", completion(f"heavy {i}"), heavy, queued=False)
            until(lambda n=in_flight: metrics(router.url, IN_FLIGHT) == n, message=f"heavy-{i} admitted")
        queue.send("heavy-2", completion("heavy 2"), heavy)  # over its share (2 of 4): it waits
        assert metrics(router.url, IN_FLIGHT) == 3
        queue.send("light", completion("light again"), light, queued=False)
        until(lambda: metrics(router.url, IN_FLIGHT) == 4, message="the light tenant admitted at once")
        assert queue.depth() == 1
        holder.release()
    for name in queue.futures:
        assert queue.result(name).status_code == 200, queue.result(name).text
    assert queue.depth() == 0
