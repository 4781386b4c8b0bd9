"""One HTTP request through the gateway, as the endpoint picker sees it on one ext_proc stream.

Request side: headers, then the body in chunks; at its end (end_of_stream, or the trailers) the request is routed
with routing.Routing.pick, exactly as the HTTP gateway routes it, and the picker answers the headers (destination
endpoints in a header and in dynamic metadata; for a long prompt picked onto a decode engine, the prefill engine in
x-prefiller-host-port) and the body (unchanged). Response side: the served endpoint from
metadata_context (the slot and the routing history move there when the gateway fell back), the first streamed
byte (TTFT), usage; the end releases the slot. close() releases it too when the stream is cut.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from envoy.service.ext_proc.v3 import external_processor_pb2 as ext
from starlette.datastructures import Headers

from ragserve.disagg import PREFILLER_HEADER
from ragserve.http.auth import ApiKey, ApiKeys
from ragserve.http.errors import ApiError
from ragserve.http.outcomes import CLIENT_CLOSED, Outcome, error_reason
from ragserve_router.disagg import prefill_engines, rank_prefill
from ragserve_router.engines import EngineRecord
from ragserve_router.epp import protocol
from ragserve_router.epp.answer import Answer
from ragserve_router.priority import tenant_of
from ragserve_router.routing import POOLING_PATHS, Picked, Routing, valid_request_id
from ragserve_router.stream_usage import HiddenUsage, hides_usage, with_usage

Admit = Callable[[str, ApiKey | None], None]  # the rate limit: (client, key), raises a 429 ApiError

log = logging.getLogger(__name__)
PATHS = {"/v1/chat/completions": True, "/v1/completions": False}  # path -> chat
DELEGATED = "delegated"  # ragserve_router_disagg_prefill_legs_total: a prefill leg left to the decode engine


@dataclass
class Labels:
    """What the answer is counted under (RouterMetrics.count), as request.state is for the HTTP gateway."""

    model: str = ""
    policy: str = ""
    engine: str = ""


class Exchange:
    def __init__(self, routing: Routing, auth: ApiKeys, admit: Admit | None = None) -> None:
        self.routing, self.auth, self.admit = routing, auth, admit
        self.started = time.monotonic()
        self.labels = Labels()
        self.headers = Headers()
        self.request_id = uuid.uuid4().hex
        self.tenant = "-"
        self.subset: set[str] | None = None
        self.body = bytearray()
        self.routed = False  # the request side is answered
        self.picked: Picked | None = None
        self.engine: EngineRecord | None = None
        self.answer: Answer | None = None
        self.hidden: HiddenUsage | None = None  # the stream's usage, asked for the quotas, not by the client
        self.over = False  # counted and released: the answer ended, was refused, or the stream was cut
        self.refused = False  # an immediate response was sent: the stream is done

    async def handle(self, req: ext.ProcessingRequest) -> list[ext.ProcessingResponse]:
        """The picker's answers to one message from the gateway, in the order the gateway expects them."""
        if not self.routed and (hint := protocol.subset_hint(req.metadata_context)) is not None:
            self.subset = hint
        kind = req.WhichOneof("request")
        try:
            if kind == "request_headers":
                return await self._request_headers(req.request_headers)
            if kind == "request_body":
                return await self._request_body(req.request_body)
            if kind == "request_trailers":
                return [*(await self._route() if not self.routed else []), protocol.trailers_done(True)]
            if kind == "response_headers":
                return self._response_headers(req)
            if kind == "response_body":
                return self._response_body(req.response_body)
            if kind == "response_trailers":
                self._end()
                return [protocol.trailers_done(False)]
        except ApiError as error:
            return [self._refuse(error)]
        except Exception:  # a bug: the client gets a 500 and the slot is released, the stream ends cleanly
            log.exception("request %s: endpoint picker failed on %s", self.request_id, kind)
            return [self._refuse(ApiError(500, "internal router error", "internal_error"))]
        return []  # attributes-only or unknown messages: nothing to answer

    async def _request_headers(self, headers: ext.HttpHeaders) -> list[ext.ProcessingResponse]:
        self.headers = protocol.header_map(headers)
        self.request_id = valid_request_id(self.headers.get("x-request-id")) or self.request_id
        key = self.auth.check(self.headers.get("authorization"))  # --api-keys-file: the HTTP gateway's keys
        client = self.headers.get("x-forwarded-for", "-").split(",")[0].strip() or "-"
        if self.admit is not None:  # and its rate limits, per key, else per client (Envoy's x-forwarded-for)
            self.admit(client, key)
        self.tenant = tenant_of(self.headers, self.routing.cfg.tenant_header, key.name if key else None, client)
        if headers.end_of_stream:  # no body (GET /v1/models ...): the least loaded engine, nothing reserved
            return [self._bodiless()]
        return []  # answered with the body, once it is routed

    async def _request_body(self, body: ext.HttpBody) -> list[ext.ProcessingResponse]:
        limit = self.routing.cfg.max_body_bytes
        if len(self.body) + len(body.body) > limit:
            raise ApiError(413, f"request body exceeds the limit of {limit} bytes", "body_too_large")
        self.body += body.body
        return await self._route() if body.end_of_stream else []

    async def _route(self) -> list[ext.ProcessingResponse]:
        """Route the whole request, as the HTTP gateway does; answer its headers, then its body."""
        self.routed = True
        path = self.headers.get(":path", "").split("?", 1)[0]
        method = self.headers.get(":method", "POST")
        pooling = path in POOLING_PATHS
        if method != "POST" or not (path in PATHS or pooling):
            raise ApiError(404, f"{method[:16]} {path[:200]}: not an OpenAI generation or pooling route", "not_found")
        eligible = None if self.subset is None else (lambda e: protocol.endpoint(e) in self.subset)
        raw = bytes(self.body)
        picked, body, raw = await self.routing.pick(
            self.headers, raw, PATHS.get(path, False), self.labels, self.started, eligible, self.tenant, pooling
        )
        self.picked, self.engine = picked, picked.decision.order[0]
        if hides_usage(body):  # the engine streams its usage for the quotas; the client gets none of it
            raw, self.hidden = json.dumps(with_usage(body)).encode(), HiddenUsage(self.routing.cfg.max_body_bytes)
        endpoints = [protocol.endpoint(e) for e in picked.decision.order[: self.routing.cfg.max_attempts]]
        headers = self._upstream_headers() | await self._prefiller(body, PATHS.get(path, False))
        # a client's own x-prefiller-host-port never reaches an engine: only the picker names a prefiller
        remove = () if PREFILLER_HEADER in headers else (PREFILLER_HEADER,)
        return [protocol.route_to(endpoints, headers, len(raw), remove), protocol.request_body(raw)]

    async def _prefiller(self, body: dict, chat: bool) -> dict[str, str]:
        """A long prompt picked onto a decode engine: the prefill engine the router's disaggregation would run its
        leg on (ragserve_router/disagg.py), named to the decode engine, which runs the leg itself."""
        if self.picked is None or not (engines := prefill_engines(self.routing, self.picked)):
            return {}
        decision = await rank_prefill(self.routing, self.picked, body, chat, self.headers, engines)
        self.routing.metrics.disagg_legs.labels(DELEGATED).inc()
        return {PREFILLER_HEADER: protocol.endpoint(decision.order[0])}

    def _upstream_headers(self) -> dict[str, str]:
        headers = {"x-request-id": self.request_id}
        if key := self.routing.cfg.engine_api_key:
            headers["authorization"] = f"Bearer {key}"
        return headers

    def _bodiless(self) -> ext.ProcessingResponse:
        self.routed = True
        pool = self.routing.pool
        healthy = [e for e in pool.healthy() if self.subset is None or protocol.endpoint(e) in self.subset]
        if not healthy:
            raise ApiError(503, "no healthy engine right now; try again", "no_engine")
        order = sorted(healthy, key=pool.load)[: self.routing.cfg.max_attempts]
        self.engine = order[0]
        return protocol.route_to([protocol.endpoint(e) for e in order], self._upstream_headers(), None)

    def _response_headers(self, req: ext.ProcessingRequest) -> list[ext.ProcessingResponse]:
        self._served(protocol.served_endpoint(req.metadata_context))
        if self.engine is not None:
            self.labels.engine = self.engine.engine_id  # the answer is counted under the engine that served it
        headers = protocol.header_map(req.response_headers)
        self.answer = Answer.of(headers, self.routing.cfg.max_body_bytes)
        if req.response_headers.end_of_stream:
            self._end()
        ratelimit = self.picked.claim.headers if self.picked is not None else None  # the tenant's x-ratelimit-*
        return [protocol.headers_done(False, ratelimit)]

    def _served(self, served: str | None) -> None:
        """The gateway fell back to another endpoint of the list: the slot and the routing history follow."""
        if not served or self.engine is None or served == protocol.endpoint(self.engine):
            return
        engine = next((e for e in self.routing.pool.all() if protocol.endpoint(e) == served), None)
        if engine is None:
            log.warning("request %s: the gateway reports it was served by %s, no known engine", self.request_id, served)
            return
        self.engine = engine
        if self.picked is not None:
            self.picked.slot.move(engine)
            self.routing.remember(self.picked.key, engine.engine_id)

    def _response_body(self, body: ext.HttpBody) -> list[ext.ProcessingResponse]:
        if self.answer is None:  # a body without headers: nothing to read it with
            self.answer = Answer.of(Headers(), self.routing.cfg.max_body_bytes)
        if self.answer.feed(body.body) and self.picked is not None and self.engine is not None:
            self.picked.first_token(self.routing.metrics, self.engine.engine_id)
        if body.end_of_stream:
            self._end()
        data = body.body if self.hidden is None else self.hidden.feed(body.body, body.end_of_stream)
        return [protocol.response_body(data, body.end_of_stream)]

    def _end(self) -> None:
        """The answer is complete: usage, the slot, latency and the answer's count, once."""
        if self.over:
            return
        self.over = True
        answer = self.answer or Answer.of(Headers(), 0)
        if self.engine is not None and self.picked is not None:
            self.picked.finish(self.routing.metrics, self.engine.engine_id, answer.usage())
        status, reason = answer.outcome()
        self._count(status, reason)

    def _refuse(self, error: ApiError) -> ext.ProcessingResponse:
        """An immediate response: the gateway answers the client; nothing was reserved (or it is released)."""
        self.over = self.refused = True
        if self.picked is not None:
            self.picked.slot.release()
        self._count(error.status, error_reason(error.status, protocol.error_json(error)))
        return protocol.immediate(error, self.request_id)

    def close(self) -> None:
        """The stream ended: a request cut before its answer's end releases its slot and counts as 499."""
        if self.over:
            return
        self.over = True
        if self.picked is not None:
            self.picked.slot.release()
        if self.routed:
            self._count(CLIENT_CLOSED, "client_closed")

    def _count(self, status: int, reason: str) -> None:
        self.routing.metrics.count(Outcome(status, reason, vars(self.labels)))
