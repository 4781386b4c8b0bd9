"""A burst of one new document through kv_aware, real router and two real engines: every request goes where the
first was sent (its blocks will be there by their turn, although no KV event or heartbeat can show them yet),
the engine computes the document once, and each response names the route's reason and kv_aware's predicted
TTFT. The engines use a cachestore that answers every Lookup after 50 ms and holds nothing, so the router's
decisions interleave at their store Lookup as on a loaded host (a real store answers too fast to show it)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from ragserve.v1 import cachestore_pb2 as pb
from ragserve.v1 import cachestore_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow  # a router, two model-loading engines and a cachestore

# ~2,800 tokens, and --work-weight 2: computing the document again elsewhere must cost clearly more (work_weight x
# prefill) than queueing behind the burst's first prefill. The tiny model prefills it in ~60 ms, so at the default
# weight (0.5) the decode terms of the requests already sent there (3 x 2 tokens) and a 40 % gap between the two
# engines' measured prefill rates could tip the burst's last request to the other engine (1 clean-clone CI run in
# many): the cost model was right to, the test's premise was not.
DOC = " ".join(f"Clause {i}: the supplier ships part {i * 7 % 31} within {i % 9} days." for i in range(160))
BURST = 4


class SlowEmptyStore(pb_grpc.CacheStoreServicer):
    def Lookup(self, request, context):
        time.sleep(0.05)
        return pb.LookupResponse(prefix_len=0)

    def Get(self, request, context):
        return iter(())

    def Put(self, request_iterator, context):
        for _ in request_iterator:
            pass
        return pb.PutResponse()


@pytest.fixture
def slow_store():
    server = grpc.server(ThreadPoolExecutor(8))
    pb_grpc.add_CacheStoreServicer_to_server(SlowEmptyStore(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)


def test_a_burst_of_one_new_document_stays_on_one_engine(cluster, until, slow_store):
    router = cluster.router("--heartbeat-interval-ms", "200", "--work-weight", "2")
    flags = ["--num-gpu-blocks", "512", "--max-model-len", "4096", "--cachestore", slow_store]
    cluster.real_engines(router, 2, *flags, ids=["burst-0", "burst-1"])
    until(lambda: httpx.get(router.url + "/ready", timeout=5).json()["engines"] == 2, timeout=60)
    replies: list[httpx.Response] = []
    barrier = threading.Barrier(BURST)

    def one(i: int) -> None:
        messages = [{"role": "system", "content": DOC}, {"role": "user", "content": f"question {i}?"}]
        body = {"model": "tiny", "messages": messages, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
        barrier.wait()
        replies.append(httpx.post(router.url + "/v1/chat/completions", json=body, timeout=300))

    with ThreadPoolExecutor(BURST) as pool:
        list(pool.map(one, range(BURST)))
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    used = [r.headers["x-ragserve-engine"] for r in replies]
    assert len(set(used)) == 1, used
    doc_tokens = min(r.json()["usage"]["prompt_tokens"] for r in replies) - 48  # less the question, about
    cached = sorted(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in replies)
    assert cached[0] == 0 and all(c >= doc_tokens for c in cached[1:]), cached  # the document computed once
    reasons = sorted(r.headers["x-ragserve-route-reason"] for r in replies)
    assert reasons.count("prefix_hit") == BURST - 1, reasons
    assert all(int(r.headers["x-ragserve-predicted-ttft-ms"]) >= 0 for r in replies)
