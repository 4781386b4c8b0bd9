"""Disaggregated prefill/decode (docs/disaggregation.md): the router's two legs.

A request is first routed as usual among the engines that decode (`--role decode` or `both`; a prefill engine is
never a candidate). When the prompt is at least --disagg-min-prompt-tokens long, the chosen engine is a decode
engine and a prefill engine shares its cachestore, the prefill leg runs first: the same body with one output token,
not streamed, sent to the prefill engine the routing policy ranks first among the prefill engines (kv_aware: cache
hits and queued prefill work). That engine answers once every block of the prompt, the partial last one included,
is in the cachestore, with the first token it sampled. Then the request goes to the decode engine (proxy.py), which
fetches the blocks and starts from that token (`first_token_id`, when the request can: ragserve.disagg.first_token),
computing no prompt token; the client gets that engine's answer, one id, its usage. A prefill leg that fails
(engine died, timed out, overloaded) is tried on the next prefill engine, and with none left the decode engine
computes the prompt itself: never an error.

Behind a gateway the endpoint picker (epp/exchange.py) makes the same choice with prefill_engines and rank_prefill
but runs no leg: it names the prefill engine to the decode engine in the `x-prefiller-host-port` header, and the
decode engine runs the leg itself (ragserve_engine/server/prefiller.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import httpx

from ragserve import tracing
from ragserve.disagg import (
    DECODE,
    FAILED,
    OK,
    PREFILL,
    REFUSED,
    first_token,
    leg_outcome,
    prefill_body,
    prefill_headers,
)
from ragserve_router.engines import CONNECT, SERVER_ERROR, TIMEOUT, EngineRecord
from ragserve_router.policies import Decision, RouteRequest

log = logging.getLogger(__name__)


def decodes(engine: EngineRecord) -> bool:
    """An engine a request may be sent to for its answer (every role but prefill)."""
    return engine.role != PREFILL


@dataclass
class PrefillLeg:
    engine_id: str = ""  # the prefill engine that computed the prompt ("": none did; the decode engine computes)
    seconds: float = 0.0
    first_token_id: int | None = None  # its first token, when the decode engine may start from it


def prefill_engines(routing, picked) -> list[EngineRecord]:
    """Prefill engines for this request (a routing.Picked): a long prompt sent to a decode engine, sharing its
    cachestore. Both front ends ask: the router runs the leg itself, the endpoint picker names the first of
    rank_prefill to the decode engine (epp/exchange.py)."""
    decode = picked.decision.order[0]
    tokens = picked.key.num_prompt_tokens
    long = tokens is not None and tokens >= routing.cfg.disagg_min_prompt_tokens
    if decode.role != DECODE or not long or not decode.cachestore:
        return []
    return [e for e in routing.pool.candidates(picked.model) if e.role == PREFILL and e.cachestore == decode.cachestore]


async def rank_prefill(routing, picked, body: dict, chat: bool, headers, engines: list[EngineRecord]) -> Decision:
    """The prefill engines in the routing policy's order (kv_aware: cache hits and queued prefill work)."""
    request = RouteRequest(picked.model, body, chat, headers, picked.key)
    return await routing.decider.decide(routing.policy(headers), request, engines)


async def run_prefill(gw, r, engines: list[EngineRecord]) -> PrefillLeg:
    """The prefill leg on `engines` (prefill_engines), before the request goes to its decode engine (see the module
    doc); a span of its own."""
    with tracing.span("router.prefill_leg", attributes={"ragserve.decode_engine": r.decision.order[0].engine_id}) as s:
        leg = await _attempts(gw, r, engines)
        if s is not None:
            s.set_attribute("ragserve.prefill_engine", leg.engine_id)
        return leg


async def _attempts(gw, r, engines: list[EngineRecord]) -> PrefillLeg:
    body, metrics = r.plan.body, gw.metrics
    decision = await rank_prefill(gw, r, body, r.plan.chat, r.request.headers, engines)
    raw, upstream = prefill_body(body), gw.proxy.upstream
    headers = prefill_headers(upstream.headers(r), r.request_id)
    for engine in decision.order[: gw.cfg.max_attempts]:
        t0 = time.monotonic()
        computed, fetched = decision.new_tokens(engine.engine_id)
        slot = gw.pool.reserve(engine, computed, r.key.hashes, fetched_tokens=fetched)
        failure, data = "", b""
        try:
            resp = await upstream.http.post(engine.url + r.path, headers, raw)
            try:
                data = await resp.aread()
            finally:
                await resp.aclose()
        except httpx.TimeoutException:
            failure = TIMEOUT
        except httpx.HTTPError:
            failure = CONNECT
        finally:
            slot.release()
        outcome = FAILED if failure else leg_outcome(resp.status_code)
        if outcome == OK:
            gw.pool.mark_success(engine)
            first = first_token(body, data, r.decision.order[0].max_model_len)
            leg = PrefillLeg(engine.engine_id, time.monotonic() - t0, first)
            metrics.disagg_legs.labels(OK).inc()
            metrics.disagg_leg_seconds.observe(leg.seconds)
            return leg
        if outcome == REFUSED:  # the request's own fault: the decode engine will say so
            metrics.disagg_legs.labels(REFUSED).inc()
            return PrefillLeg()
        gw.pool.mark_failure(engine, failure or SERVER_ERROR)
        metrics.disagg_legs.labels("retried").inc()
        log.warning("request %s: prefill engine %s failed (%s)", r.request_id, engine.engine_id, failure or "5xx")
    metrics.disagg_legs.labels(FAILED).inc()  # the decode engine computes the prompt
    return PrefillLeg()
