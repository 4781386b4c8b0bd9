"""Disaggregated prefill/decode (docs/disaggregation.md): the router's two legs.

A request is first routed as usual among the engines that decode (`--role decode` or `both`; a prefill engine is
never a candidate). When the prompt is at least --disagg-min-prompt-tokens long, the chosen engine is a decode
engine and a prefill engine shares its cachestore, the prefill leg runs first: the same body with one output token,
not streamed, sent to the prefill engine the routing policy ranks first among the prefill engines (kv_aware: cache
hits and queued prefill work). That engine answers once every block of the prompt, the partial last one included,
is in the cachestore. Then the request goes to the decode engine (proxy.py), which fetches the blocks and computes
only the last prompt token: the client gets that engine's answer, one id, its usage. A prefill leg that fails
(engine died, timed out, overloaded) is tried on the next prefill engine, and with none left the decode engine
computes the prompt itself: never an error.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

import httpx
from prometheus_client import Counter, Histogram

from ragserve import tracing
from ragserve_router.engines import CONNECT, SERVER_ERROR, TIMEOUT, EngineRecord
from ragserve_router.policies import RouteRequest

log = logging.getLogger(__name__)
PREFILL, DECODE, BOTH = "prefill", "decode", "both"
# generation-only fields: the prefill leg computes the prompt and one token, whatever the client asked for
GENERATION_ONLY = (
    "stream", "stream_options", "n", "best_of", "use_beam_search", "logprobs", "top_logprobs", "prompt_logprobs",
    "echo", "min_tokens", "max_completion_tokens", "return_token_ids", "resume_token_ids",
)  # fmt: skip


def decodes(engine: EngineRecord) -> bool:
    """An engine a request may be sent to for its answer (every role but prefill)."""
    return engine.role != PREFILL


def prefill_body(body: dict) -> bytes:
    """The prefill leg's request: the client's prompt and settings, one token, not streamed."""
    leg = {k: v for k, v in body.items() if k not in GENERATION_ONLY}
    return json.dumps({**leg, "max_tokens": 1, "stream": False}).encode()


class DisaggMetrics:
    def __init__(self, registry) -> None:
        p = "ragserve_router_disagg_"
        self.legs = Counter(p + "prefill_legs", "Prefill legs by outcome", ["outcome"], registry=registry)
        self.seconds = Histogram(
            p + "prefill_seconds", "Prefill leg: sent to the prefill engine until its KV is in the cachestore",
            registry=registry, buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64),
        )  # fmt: skip


@dataclass
class PrefillLeg:
    engine_id: str = ""  # the prefill engine that computed the prompt ("": none did; the decode engine computes)
    seconds: float = 0.0


def prefill_engines(gw, r) -> list[EngineRecord]:
    """Prefill engines for this request: a long prompt sent to a decode engine, sharing its cachestore."""
    decode = r.decision.order[0]
    tokens = r.key.num_prompt_tokens
    if decode.role != DECODE or tokens is None or tokens < gw.cfg.disagg_min_prompt_tokens or not decode.cachestore:
        return []
    return [e for e in gw.pool.candidates(r.model) if e.role == PREFILL and e.cachestore == decode.cachestore]


async def run_prefill(gw, r, metrics: DisaggMetrics, engines: list[EngineRecord]) -> PrefillLeg:
    """The prefill leg on `engines` (prefill_engines), before the request goes to its decode engine (see the module
    doc); a span of its own."""
    with tracing.span("router.prefill_leg", attributes={"ragserve.decode_engine": r.decision.order[0].engine_id}) as s:
        leg = await _attempts(gw, r, metrics, engines)
        if s is not None:
            s.set_attribute("ragserve.prefill_engine", leg.engine_id)
        return leg


async def _attempts(gw, r, metrics: DisaggMetrics, engines: list[EngineRecord]) -> PrefillLeg:
    body = r.plan.body
    decision = await gw.decider.decide(gw.policy(r.request.headers), RouteRequest(r.model, body, r.plan.chat,
                                       r.request.headers, r.key), engines)  # fmt: skip
    raw, upstream = prefill_body(body), gw.proxy.upstream
    headers = upstream.headers(r) | {"X-Request-Id": f"{r.request_id}-prefill", "Accept": "application/json"}
    for engine in decision.order[: gw.cfg.max_attempts]:
        t0 = time.monotonic()
        predicted = decision.predictions.get(engine.engine_id)
        slot = gw.pool.reserve(engine, predicted.computed_tokens if predicted else 0, r.key.hashes)
        failure = ""
        try:
            resp = await upstream.http.post(engine.url + r.path, headers, raw)
            try:
                await resp.aread()
            finally:
                await resp.aclose()
        except httpx.TimeoutException:
            failure = TIMEOUT
        except httpx.HTTPError:
            failure = CONNECT
        finally:
            slot.release()
        if not failure and resp.status_code == 200:
            gw.pool.mark_success(engine)
            leg = PrefillLeg(engine.engine_id, time.monotonic() - t0)
            metrics.legs.labels("ok").inc()
            metrics.seconds.observe(leg.seconds)
            return leg
        if not failure and resp.status_code < 500:  # the request's own fault: the decode engine will say so
            metrics.legs.labels("refused").inc()
            return PrefillLeg()
        gw.pool.mark_failure(engine, failure or SERVER_ERROR)
        metrics.legs.labels("retried").inc()
        log.warning("request %s: prefill engine %s failed (%s)", r.request_id, engine.engine_id, failure or "5xx")
    metrics.legs.labels("failed").inc()  # the decode engine computes the prompt
    return PrefillLeg()
