"""Tracing across the stack: real `ragserve router`, `ragserve engine` (tiny model, --cachestore) and
`ragserve cachestore` processes export OTLP/gRPC to a receiver in this process (tests/helpers/otlp.py).

One request through the router makes one trace: router.route -> engine.request -> engine.queue / prefill /
decode, and the engine's cachestore calls (cachestore.lookup, cachestore.put) under engine.request. A second
engine asked directly with the client's own `traceparent` fetches those blocks: its trace continues the
client's span and holds cachestore.get, and its prefill reports the fetched tokens.
"""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from tests.helpers.engine_server import LONG_CONTEXT, MODEL_NAME
from tests.helpers.otlp import Receiver, Span
from tests.helpers.process import until
from tests.helpers.traced_stack import traced_stack

CHAT = {
    "model": MODEL_NAME,
    "messages": [{"role": "system", "content": LONG_CONTEXT}, {"role": "user", "content": "What is a block table?"}],
    "max_tokens": 3,
    "temperature": 0,
}
CLIENT_TRACE, CLIENT_SPAN = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"


@pytest.fixture
def stack(tmp_path):
    engines = [(True, ("--engine-id", "eng-a")), (False, ())]  # the second is not registered: the test asks it
    with traced_stack(tmp_path, (), engines) as (receiver, url, procs):
        yield receiver, url, procs[1].url


def one(spans: list[Span], name: str) -> Span:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, (name, [(s.service, s.name) for s in spans])
    return found[0]


def complete(receiver: Receiver, trace_id: str, names: set[str]) -> list[Span]:
    return until(lambda: names <= {s.name for s in receiver.trace(trace_id)} and receiver.trace(trace_id), what=names)


def test_one_trace_spans_router_engine_and_cachestore(stack):
    receiver, url, direct = stack
    resp = httpx.post(url + "/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "traced-1"}, timeout=60)
    assert resp.status_code == 200, resp.text
    traced = lambda: [s for s in receiver.named("router.route") if s.attributes["ragserve.request_id"] == "traced-1"]  # noqa: E731
    routes = until(traced, what="the router's span")
    trace_id = routes[0].trace_id
    names = {"router.route", "engine.request", "engine.queue", "engine.prefill", "engine.decode"}
    spans = complete(receiver, trace_id, names | {"cachestore.lookup", "cachestore.put"})

    route = one(spans, "router.route")
    assert (route.service, route.parent_id) == ("ragserve-router", "")
    assert route.attributes["ragserve.engine"] == "eng-a" and route.attributes["ragserve.reason"]
    assert route.attributes["ragserve.predicted_cached_tokens"] == 0  # a cold cache, predicted as such
    request = one(spans, "engine.request")
    assert (request.service, request.parent_id) == ("ragserve-engine", route.span_id)
    for name in ("engine.queue", "engine.prefill", "engine.decode"):
        assert one(spans, name).parent_id == request.span_id, name
    calls = [s for s in spans if s.name.startswith("cachestore.")]  # a decode step may complete a block: 2 puts
    assert {(s.service, s.parent_id) for s in calls} == {("ragserve-cachestore", request.span_id)}
    prefill = one(spans, "engine.prefill").attributes
    assert prefill["ragserve.cached_tokens"] == 0 and prefill["ragserve.fetched_tokens"] == 0
    assert prefill["ragserve.computed_tokens"] == prefill["ragserve.prompt_tokens"] > 0
    assert sum(s.attributes["ragserve.stored_blocks"] for s in calls if s.name == "cachestore.put") > 0
    assert one(spans, "engine.decode").attributes["ragserve.generation_tokens"] == CHAT["max_tokens"]

    # the other engine, asked with the client's traceparent, continues that trace and fetches the blocks
    traceparent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    resp = httpx.post(direct + "/v1/chat/completions", json=CHAT, headers={"traceparent": traceparent}, timeout=60)
    assert resp.status_code == 200, resp.text
    spans = complete(receiver, CLIENT_TRACE, names - {"router.route"} | {"cachestore.lookup", "cachestore.get"})
    request = one(spans, "engine.request")
    assert request.parent_id == CLIENT_SPAN
    assert {s.parent_id for s in spans if s.name.startswith("cachestore.")} == {request.span_id}
    prefill = one(spans, "engine.prefill").attributes
    assert prefill["ragserve.fetched_tokens"] > 0
    assert prefill["ragserve.cached_tokens"] >= prefill["ragserve.fetched_tokens"]
    assert prefill["ragserve.computed_tokens"] == prefill["ragserve.prompt_tokens"] - prefill["ragserve.cached_tokens"]


def test_tracing_off_loads_no_sdk():
    """Without the flag nothing of ragserve imports opentelemetry (FastAPI itself imports the API package)."""
    code = (
        "import sys, ragserve_router.server, ragserve_engine.server.launcher, ragserve_cachestore.cli\n"
        "import ragserve_cachestore.server, ragserve_engine.kv_connector, ragserve.tracing as t\n"
        "assert t.headers() == {} and t.extract({'traceparent': '00-' + '1' * 32 + '-' + '2' * 16 + '-01'}) is None\n"
        "with t.span('x') as s: assert s is None\n"
        "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
