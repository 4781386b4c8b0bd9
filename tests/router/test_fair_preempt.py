"""--tenant-fair-share with --engine-priority end to end: a light tenant's request does not wait for a heavy tenant's
answers to end. The router admits it past its places (the light tenant is under its allocation) with its rank, 0,
as its engine priority; the heavy tenant's requests carry ranks 0 and 1, and the engine (--scheduling-policy
priority) preempts the rank-1 one for it at once. The preempted request recomputes later and still ends whole.

Built, not timed: the heavy tenant's two long streams hold both places and both engine seats (the engine's running
gauge says when) before the light request is sent; it ends while they still decode hundreds of tokens."""

from __future__ import annotations

from ragserve.metric_names import NUM_PREEMPTIONS, NUM_REQUESTS_RUNNING
from tests.reliability.conftest import ready, start_engines
from tests.router.test_flow_control import DEPTH, IN_FLIGHT, Queue, completion

LONG = 1000  # tokens each heavy stream decodes: seconds, against the light request's one prefill and two tokens
# (it ends ~0.3 s after the first heavy stream starts: ~90 of its tokens)


def test_a_light_tenant_preempts_the_heavy_tenants_newest_place_instead_of_waiting(cluster, metrics, until):
    router = cluster.router("--max-inflight-per-engine", "2", "--tenant-fair-share", "--engine-priority",
                            "--tenant-header", "X-Tenant", "--heartbeat-interval-ms", "5000")  # fmt: skip
    (engine,) = start_engines(cluster, router, ["fair-preempt-0"], "--max-model-len", "4096", "--max-num-seqs", "2",
                              "--scheduling-policy", "priority")  # fmt: skip
    until(lambda: ready(router)["healthy_engines"] == 1, timeout=120, message="engine registered")
    queue = Queue(router.url, metrics, until)
    for i in range(2):  # ranks 0 and 1: the heavy tenant's first and second place
        queue.send(f"heavy-{i}", completion(f"heavy {i}", max_tokens=LONG), {"X-Tenant": "heavy"}, queued=False)
        until(lambda n=i + 1: metrics.total(engine.url, NUM_REQUESTS_RUNNING) == n, message=f"heavy-{i} running")
    assert metrics(router.url, IN_FLIGHT) == 2  # every place taken
    queue.send("light", completion("light"), {"X-Tenant": "light"}, queued=False)
    assert queue.result("light").status_code == 200, queue.result("light").text
    # admitted past the places, not queued behind the heavy answers; the engine took a seat back for it
    assert queue.done == ["light"], queue.done
    assert metrics.total(router.url, DEPTH) == 0
    assert metrics.total(engine.url, NUM_PREEMPTIONS + "_total") >= 1
    for name in ("heavy-0", "heavy-1"):  # the preempted one recomputed: nothing lost
        resp = queue.result(name)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == LONG
    until(lambda: metrics(router.url, IN_FLIGHT) == 0, message="every place back")
