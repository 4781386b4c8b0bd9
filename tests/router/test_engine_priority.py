"""--engine-priority end to end: the router sends a request's class to the engine as its scheduling priority, and an
engine on --scheduling-policy priority admits a critical request ahead of standard ones already waiting in its own
queue (not the router's: --max-inflight-per-engine above the engine's one seat lets every request through), at once:
it preempts the standard request holding the only seat.

Built, not timed: the engine's only seat (--max-num-seqs 1) is held by a long stream; the standard requests reach
the engine while it is frozen (SIGSTOP), then wait in its queue (its vllm:num_requests_waiting gauge says when);
the critical request arrives after them and preempts the holder; the holder's client leaves after it ended. The
engine runs one request at a time, so the order they complete in is the order it admitted them in (the standard
ones, that reached it frozen, in whatever order it read them)."""

from __future__ import annotations

from ragserve.metric_names import NUM_PREEMPTIONS, NUM_REQUESTS_RUNNING, NUM_REQUESTS_WAITING
from tests.helpers.process import frozen
from tests.reliability.conftest import ready, start_engines
from tests.router.test_flow_control import IN_FLIGHT, Holder, Queue, completion

HOLD_TOKENS = 4000  # the holder's stream: seconds of decoding, against the few steps its queue takes to build


def test_the_engine_admits_a_critical_request_before_the_standard_ones_waiting_in_its_queue(cluster, metrics, until):
    router = cluster.router("--max-inflight-per-engine", "8", "--engine-priority", "--heartbeat-interval-ms", "5000")
    (engine,) = start_engines(cluster, router, ["priority-0"], "--max-model-len", "4096", "--max-num-seqs", "1",
                              "--scheduling-policy", "priority")  # fmt: skip
    until(lambda: ready(router)["healthy_engines"] == 1, timeout=120, message="engine registered")

    def engine_queue() -> tuple[float, float]:
        return metrics.total(engine.url, NUM_REQUESTS_RUNNING), metrics.total(engine.url, NUM_REQUESTS_WAITING)

    queue = Queue(router.url, metrics, until)
    holder = Holder(router.url, metrics, until, max_tokens=HOLD_TOKENS)
    until(lambda: engine_queue() == (1, 0), message="the holder in the engine's seat")
    standard = [f"standard-{i}" for i in range(3)]
    with frozen([engine]):  # the holder makes no progress while the router sends these on
        for i, name in enumerate(standard):
            queue.send(name, completion(name), {}, queued=False)
            until(lambda n=i + 2: metrics(router.url, IN_FLIGHT) == n, message=f"{name} sent to the engine")
    until(lambda: engine_queue() == (1, 3), message="the standard requests waiting in the engine")
    queue.send("critical", completion("critical"), {"X-Ragserve-Priority": "1"}, queued=False)
    # the engine preempts the holder (lower priority) for the critical request's seat: it ends while the holder's
    # client still waits for its stream, and before the standard requests that reached the engine first
    assert queue.result("critical").status_code == 200, queue.result("critical").text
    assert queue.done == ["critical"], queue.done
    assert metrics.total(engine.url, NUM_PREEMPTIONS + "_total") >= 1
    assert metrics.total(router.url, "ragserve_router_queue_depth") == 0  # the router queued none of them
    holder.release()  # its client leaves: the engine aborts it and its seat goes to the standard requests
    for name in queue.futures:
        assert queue.result(name).status_code == 200, queue.result(name).text
    # FCFS, or the class not sent, would run the critical request last
    assert queue.done[0] == "critical" and sorted(queue.done[1:]) == standard, queue.done
