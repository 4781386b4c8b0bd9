"""A disaggregated request's trace (docs/disaggregation.md): real router, --role prefill and --role decode engines
(tiny model) and cachestore, exporting OTLP to a receiver in this process. One trace: router.route holds
router.prefill_leg (the prefill engine's engine.request under it) and the decode engine's engine.request."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers.process import until
from tests.helpers.traced_stack import traced_stack
from tests.observability.test_tracing import CHAT, complete, one


@pytest.fixture
def pd_stack(tmp_path):
    engines = [
        (True, ("--role", "prefill", "--engine-id", "pd-p")),
        (True, ("--role", "decode", "--engine-id", "pd-d")),
    ]
    with traced_stack(tmp_path, ("--disagg-min-prompt-tokens", "32"), engines) as (receiver, url, _):
        yield receiver, url


def test_prefill_leg_has_its_span(pd_stack):
    receiver, url = pd_stack
    resp = httpx.post(url + "/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "pd-1"}, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-ragserve-engine"] == "pd-d"
    traced = lambda: [s for s in receiver.named("router.route") if s.attributes["ragserve.request_id"] == "pd-1"]  # noqa: E731
    trace_id = until(traced, what="the router's span")[0].trace_id
    spans = until(
        lambda: len([s for s in complete(receiver, trace_id, {"router.prefill_leg"}) if s.name == "engine.request"])
        == 2 and receiver.trace(trace_id),
        what="both engines' spans",
    )  # fmt: skip
    route, leg = one(spans, "router.route"), one(spans, "router.prefill_leg")
    assert leg.parent_id == route.span_id
    assert leg.attributes == {"ragserve.decode_engine": "pd-d", "ragserve.prefill_engine": "pd-p"}
    requests = {s.parent_id for s in spans if s.name == "engine.request"}
    assert requests == {leg.span_id, route.span_id}  # the prefill engine's under the leg, the decode engine's not
