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


def test_a_heavy_tenant_takes_the_places_a_light_tenant_does_not_ask_for_and_not_the_ones_it_does(
    cluster, metrics, until
):
    """--tenant-fair-share, 4 places, max-min fair by demand: the light tenant asks for one, so the heavy one may
    take the other three (the old even split held it at two); when the light tenant asks for a second, its
    allocation is two, and the next free place goes to it, not to the heavy tenant's request waiting before it."""
    router = cluster.router("--max-inflight-per-engine", "4", "--tenant-fair-share", "--tenant-header", "X-Tenant",
                            "--heartbeat-interval-ms", "5000")  # fmt: skip
    (engine,) = start_engines(cluster, router, ["share-0"], "--max-model-len", "1024")
    until(lambda: ready(router)["healthy_engines"] == 1, timeout=120, message="engine registered")
    heavy, light = {"X-Tenant": "heavy"}, {"X-Tenant": "light"}
    queue = Queue(router.url, metrics, until)
    with frozen([engine]):
        light_holder = Holder(router.url, metrics, until, light)
        heavy_holder = Holder(router.url, metrics, until, heavy, in_flight=2)
        for i, in_flight in ((1, 3), (2, 4)):  # within its allocation (3 of 4): admitted at once
            queue.send(f"heavy-{i}", completion(f"heavy {i}"), heavy, queued=False)
            until(lambda n=in_flight: metrics(router.url, IN_FLIGHT) == n, message=f"heavy-{i} admitted")
        queue.send("heavy-3", completion("heavy 3"), heavy)  # no place free: it waits
        queue.send("light-2", completion("light 2"), light)  # and so does this one
        heavy_holder.release()  # one place frees: the light tenant's allocation (2) lacks one, the heavy one's not
        until(lambda: queue.depth() == 1, message="a waiter admitted")
        assert metrics(router.url, IN_FLIGHT) == 4
    for name in queue.futures:  # heavy-3 is admitted when one of the others ends
        assert queue.result(name).status_code == 200, queue.result(name).text
    light_holder.release()
    assert queue.done.index("light-2") < queue.done.index("heavy-3"), queue.done
    until(lambda: metrics(router.url, IN_FLIGHT) == 0, message="every place back")
