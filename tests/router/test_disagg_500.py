"""A live prefill engine answering the prefill leg HTTP 500 (not a draining engine's 503): a request failing inside
the engine's step, which a real engine answers 500 with scope `request` and keeps serving. No request input makes a
healthy engine fail so (that would be a bug), so the fault is injected into a real `ragserve engine` process, as in
tests/reliability/test_poison.py: it fails the requests that carry FAULT_SEED. The router retries the leg on the
other prefill engine and the decode engine answers what a `both` engine answers, token for token.

The router runs the session policy (test_disagg.SESSION) with a `user` its ring puts on the faulty engine first, so
the leg meets the 500 whatever the engines measured (under kv_aware the healthy engine was ranked first in ~1 run in
8)."""

from __future__ import annotations

import httpx
import pytest

from ragserve_router.hashring import ring_order
from tests.router.conftest import Cluster
from tests.router.test_disagg import (
    ENGINE_FLAGS,
    SESSION,
    answer,
    legs,
    metric,
    prompt_tokens,
    rag,
    server_errors,
    start_pd,
)

pytestmark = pytest.mark.slow  # several processes, each loading a model
FAULT_SEED = 500500  # a request with this seed fails in the faulty engine's step (greedy: the seed changes nothing)
FAULTY = f"""
import sys
from ragserve_engine import sample_step
real = sample_step.check_stop

def check_stop(req, seq, criteria):
    if req.params.seed == {FAULT_SEED}:
        raise RuntimeError("injected fault in the stop check")
    real(req, seq, criteria)

sample_step.check_stop = check_stop
from ragserve.cli import main
sys.exit(main())
"""


def test_prefill_engine_answering_500_loses_no_request(tmp_path, model_dir, until):
    cluster = Cluster(tmp_path, model_dir)
    fleet = start_pd(cluster, tmp_path, 10_000, 1, None, *SESSION)
    try:
        flags = [*ENGINE_FLAGS, "--cachestore", fleet.store.address, "--role", "prefill"]
        (faulty,) = cluster.real_engines(fleet.router, 1, *flags, ids=["pd-prefill-500"], launcher=("-c", FAULTY))
        (reference,) = cluster.real_engines(None, 1, *ENGINE_FLAGS, ids=["pd-both"])
        cluster.wait_registered(faulty)
        until(lambda: httpx.get(reference.url + "/ready", timeout=5).status_code == 200, timeout=300, message="ready")
        ids = ["pd-prefill", "pd-prefill-500"]
        user = next(f"u{i}" for i in range(100) if ring_order(f"session:u{i}", ids)[0] == "pd-prefill-500")
        warm = rag(11, "Which item weighs 52 grams?", max_tokens=8, temperature=0, ignore_eos=True, user=user)
        body = warm | {"seed": FAULT_SEED}
        expected, _, _ = answer(reference.url, body)
        stored = lambda: metric(fleet.router.url, "ragserve_router_kv_events_total", kind="stored")  # noqa: E731
        events = stored()
        resp = httpx.post(faulty.url + "/v1/chat/completions", json=body | {"max_tokens": 1}, timeout=300)
        assert resp.status_code == 500 and resp.headers["x-ragserve-error-scope"] == "request", resp.text
        answer(faulty.url, warm)  # the faulty engine holds the prompt now (and ranks first for the leg, by `user`)
        until(lambda: stored() > events, message="the router knows (its KV events) the faulty engine holds the prompt")
        before, computed = legs(fleet.router), prompt_tokens(fleet.prefill)

        texts, usage, _ = answer(fleet.router.url, body)
        assert texts == expected
        assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"]  # the retry's KV
        assert legs(fleet.router) == before | {"retried": before["retried"] + 1, "ok": before["ok"] + 1}
        assert server_errors(fleet.router, faulty) == 1  # its 500
        assert prompt_tokens(fleet.prefill) > computed  # the retry ran on the other prefill engine
        assert answer(faulty.url, warm)[0] == answer(reference.url, warm)[0]  # and it keeps serving
    finally:
        cluster.stop_all()
        fleet.store.stop()
