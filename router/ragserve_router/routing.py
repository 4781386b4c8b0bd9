"""Where one request goes: the routing path both front ends call, the HTTP gateway (app.py) and the Gateway API
endpoint picker (epp/). Parse and check the OpenAI body, find the candidates, shed a sheddable request when every
candidate is saturated, admit it (its tenant's quota, its turn in the router queue: gate.py), ask the policy,
reserve the slot on the first engine, count the decision; and, once the engine answered, account its first
token, usage and latency (Picked)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ragserve.http.body import parse_json_object
from ragserve.http.errors import ApiError
from ragserve.http.limits import check_request
from ragserve.router_args import POLICIES, RouterConfig
from ragserve_router.cost_model import output_tokens
from ragserve_router.disagg import decodes
from ragserve_router.engines import EngineRecord
from ragserve_router.gate import Claim, Gate
from ragserve_router.metrics import RouterMetrics
from ragserve_router.policies import Decider, Decision, RouteRequest
from ragserve_router.pool import EnginePool
from ragserve_router.priority import SHEDDABLE, traffic_class, with_engine_priority
from ragserve_router.prompt import RoutingKey, Tokenizers
from ragserve_router.slots import Slot
from ragserve_router.state import RouterState

log = logging.getLogger(__name__)
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
POLICY_HEADER = "x-ragserve-policy"
POOLING_POLICY = "least_loaded"  # embeddings, rerank and score: nothing cached to route to
# the pooling endpoints and the aliases vLLM (and so the engine) also serves them under
POOLING_PATHS = ("/v1/embeddings", "/v1/rerank", "/rerank", "/v2/rerank", "/v1/score", "/score")


def valid_request_id(given: str | None) -> str | None:
    """The client's X-Request-Id when well formed (it goes into logs and headers), else None."""
    return given if given and _REQUEST_ID.fullmatch(given) else None


def parse_body(raw: bytes) -> tuple[dict, str]:
    body = parse_json_object(raw)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required and must be a string", "missing_model", param="model")
    return body, model


def prompt_estimate(key: RoutingKey, raw: bytes) -> int:
    """The prompt's tokens as the router counted them, else a guess from the body's size (4 bytes a token)."""
    return key.num_prompt_tokens if key.num_prompt_tokens is not None else max(1, len(raw) // 4)


@dataclass(frozen=True)
class Picked:
    """A routing decision and the slot it holds on the engine, from the decision to the answer's end."""

    model: str
    decision: Decision
    key: RoutingKey
    started: float  # when the request arrived (monotonic)
    slot: Slot
    claim: Claim  # its quota and queue place (released with the slot)

    def fields(self) -> dict[str, Any]:
        """This decision's fields, to build a subclass (upstream.Routed) from it."""
        return {name: getattr(self, name) for name in _PICKED_FIELDS}

    def first_token(self, metrics: RouterMetrics, engine_id: str) -> float:
        """The engine's first streamed byte: its prefill is over; TTFT observed (and returned)."""
        self.slot.first_token()
        elapsed = time.monotonic() - self.started
        metrics.child(metrics.ttft, self.model).observe(elapsed)
        metrics.child(metrics.engine_ttft, engine_id).observe(elapsed)
        return elapsed

    def finish(self, metrics: RouterMetrics, engine_id: str, usage: dict | None = None) -> None:
        """The request is over on the engine: its usage accounted, its slot released, its latency observed."""
        self.account_usage(metrics, engine_id, usage)
        self.claim.settle(usage)
        self.slot.release()
        metrics.child(metrics.latency, self.model).observe(time.monotonic() - self.started)

    def account_usage(self, metrics: RouterMetrics, engine_id: str, usage: dict | None) -> None:
        """Routing accuracy: predicted cached tokens vs. what the engine reports (when it does)."""
        if not isinstance(usage, dict):
            return
        details = usage.get("prompt_tokens_details") or {}
        actual = details.get("cached_tokens") if isinstance(details, dict) else None
        predicted = self.decision.predicted_cached_tokens(engine_id, self.key)
        if isinstance(usage.get("prompt_tokens"), int):
            metrics.child(metrics.prompt_tokens, engine_id).inc(usage["prompt_tokens"])
        if isinstance(actual, int) and predicted is not None:
            metrics.child(metrics.predicted_cached, engine_id).inc(predicted)
            metrics.child(metrics.actual_cached, engine_id).inc(actual)


_PICKED_FIELDS = tuple(f.name for f in dataclasses.fields(Picked))


@dataclass
class Routing:
    """What both front ends route with: the engines, the index, the policies and the metrics."""

    cfg: RouterConfig
    state: RouterState
    pool: EnginePool
    tokenizers: Tokenizers
    decider: Decider
    metrics: RouterMetrics
    gate: Gate
    draining: bool = field(default=False, kw_only=True)  # SIGTERM: not ready, finishing what is in flight
    _tasks: set[asyncio.Task] = field(default_factory=set, kw_only=True)

    def background(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def pick(
        self,
        headers: Mapping[str, str],
        raw: bytes,
        chat: bool,
        labels: Any,  # request.state or the EPP's labels: .model and .policy are set here (metric labels)
        started: float,
        eligible: Callable[[EngineRecord], bool] | None = None,
        tenant: str = "-",
        pooling: bool = False,
    ) -> tuple[Picked, dict, bytes]:
        """Decide where the request goes and reserve its slot on the first engine of that order, once the gate
        admits it; also returns the body, parsed and as sent upstream (with --engine-priority, the class's
        scheduling priority added where the client set none). `pooling` (embeddings, rerank, score): no KV cache
        to route to, so the least-loaded engine serving the model; the engine checks the body."""
        body, model = parse_body(raw)
        if not pooling:
            check_request(body, chat)  # the same limits the engine applies (ragserve.http.limits)
        candidates = self.candidates(labels, model, eligible)
        policy = POOLING_POLICY if pooling else self.policy(headers)
        cls = traffic_class(headers, body)
        self.shed(cls, model, candidates)
        t0 = time.monotonic()
        if pooling:
            key = RoutingKey([], 0)
        else:
            key = await self.tokenizers.routing_key(self.pool.spec(model), model, body, chat, len(raw))
        spent = time.monotonic() - t0
        claim = await self.gate.enter(model, cls, tenant, prompt_estimate(key, raw))
        try:
            t0 = time.monotonic()
            candidates = self.room(self.candidates(labels, model, eligible), cls)  # the engines now, after any wait
            decision = await self.decider.decide(policy, RouteRequest(model, body, chat, headers, key), candidates)
        except BaseException:
            claim.release()
            raise
        first = decision.order[0]
        chosen = decision.predictions.get(first.engine_id)
        out = 0 if pooling else output_tokens(body)
        computed, fetched = decision.new_tokens(first.engine_id)
        slot = self.pool.reserve(first, computed, key.hashes, claim.release, out, fetched)
        self.metrics.routing_latency.observe(spent + time.monotonic() - t0)
        self.metrics.child(self.metrics.decisions, decision.policy, decision.reason).inc()
        if chosen:
            self.metrics.observe_prediction(first.engine_id, chosen)
        labels.policy = decision.policy
        self.remember(key, first.engine_id)
        rank = claim.rank if self.gate.flow.preempt else None
        if self.cfg.engine_priority and not pooling and (ranked := with_engine_priority(body, cls, rank)) is not None:
            body, raw = ranked, json.dumps(ranked).encode()
        return Picked(model, decision, key, started, slot, claim), body, raw

    def candidates(
        self, labels: Any, model: str, eligible: Callable[[EngineRecord], bool] | None = None
    ) -> list[EngineRecord]:
        """The healthy (and eligible) engines serving `model` (404 for a model nobody serves, 503 while none is)."""
        if model not in self.pool.served_models and model not in self.pool.models():  # models() adds to it
            raise ApiError(404, f"The model `{model}` does not exist.", "model_not_found", param="model")
        labels.model = model  # a served model: a bounded metric label
        candidates = [e for e in self.pool.candidates(model) if decodes(e) and (eligible is None or eligible(e))]
        if not candidates:  # a model the cluster serves, with no engine up right now: come back soon
            retry = {"Retry-After": str(max(1, round(self.cfg.probe_interval)))}
            message = f"no healthy engine serves model `{model}` right now; try again"
            raise ApiError(503, message, "no_engine", None, retry)
        return candidates

    def policy(self, headers: Mapping[str, str]) -> str:
        """--policy, or the client's X-Ragserve-Policy where --allow-policy-header lets it choose."""
        if self.cfg.allow_policy_header and (wanted := headers.get(POLICY_HEADER)):
            if wanted not in POLICIES:
                raise ApiError(400, f"unknown policy {wanted!r}; use one of {', '.join(POLICIES)}", "invalid_policy")
            return wanted
        return self.cfg.policy

    def saturated(self, engine: EngineRecord) -> bool:
        """Over --saturation-queue-depth prompts waiting for their prefill, or over --saturation-kv-usage."""
        cfg = self.cfg
        return self.pool.queue_depth(engine) > cfg.saturation_queue_depth or (
            self.pool.kv_usage(engine) > cfg.saturation_kv_usage
        )

    def room(self, candidates: list[EngineRecord], cls: str) -> list[EngineRecord]:
        """The candidates below --max-inflight-per-engine, less the critical reserve for other classes (all of
        them when it is off, or when none is: the queue's places follow the candidates, so that only happens
        while engines come and go)."""
        cap = self.gate.flow.per_engine_for(cls)
        under = [e for e in candidates if self.pool.health[e.engine_id].inflight < cap]
        return under if cap and under else candidates

    def shed(self, cls: str, model: str, candidates: list[EngineRecord]) -> None:
        """A sheddable request is refused with 429 while every candidate is saturated."""
        if cls == SHEDDABLE and all(self.saturated(e) for e in candidates):
            self.metrics.shed.labels(cls, "saturated").inc()
            raise ApiError(
                429, f"every engine serving `{model}` is saturated and this request is sheddable (priority < 0); "
                "try again later", "saturated", None, {"Retry-After": "1"},
            )  # fmt: skip

    def remember(self, key: RoutingKey, engine_id: str) -> None:
        """Routing history (the approximate index): the prompt's blocks are going to this engine."""
        if key.hashes and not self.state.record_route_now(key.hashes, engine_id):
            self.background(self._record(key.hashes, engine_id))

    async def _record(self, hashes: list[bytes], engine_id: str) -> None:
        try:
            await self.state.record_route(hashes, engine_id)
        except Exception as exc:  # the approximate index is best effort
            log.debug("could not record route: %s", exc)
