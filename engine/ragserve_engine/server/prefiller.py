"""A decode engine's own prefill leg (docs/disaggregation.md, "Behind a gateway"): the endpoint picker names the
prefill engine in the `x-prefiller-host-port` request header (llm-d's) instead of running the leg, and a
`--role decode` engine sends that engine the router's prefill leg (ragserve.disagg.prefill_body: the prompt, one
token, not streamed) before it admits the request, which then fetches the prompt's blocks from the cachestore and
starts from the leg's first token (ragserve.disagg.first_token): it computes no prompt token, or only the last one
when the request cannot start there. A leg that fails or times out costs a recompute here, never an error. The header is
honoured only when its host is an IP in --prefiller-allow (no name lookups: a client or a compromised picker cannot
make the engine call anywhere else); otherwise it is ignored, with a log line."""

from __future__ import annotations

import ipaddress
import logging
import time
import uuid

import httpx
from fastapi import Request
from prometheus_client import Counter, Histogram

from ragserve import metric_names as m
from ragserve.disagg import (
    DECODE,
    FAILED,
    LEG_SECONDS_BUCKETS,
    OK,
    PREFILLER_HEADER,
    REFUSED,
    first_token,
    leg_outcome,
    prefill_body,
    prefill_headers,
)
from ragserve.engine_args import ServerConfig

log = logging.getLogger("ragserve_engine.server")
IGNORED = "ignored"  # the header named a prefiller this engine may not call, or none it can parse
OUTCOMES = (OK, REFUSED, FAILED, IGNORED)


class Prefiller:
    def __init__(self, config: ServerConfig, role: str, model_name: str, registry) -> None:
        self.allowed = config.prefiller_networks()
        self.decodes = role == DECODE  # only a decode engine looks the prompt's tail block up: a leg pays off there
        self.role = role
        self.timeout = config.prefiller_timeout
        self.api_key = config.api_key  # the pool's engines share it (the router's --engine-api-key)
        self.model_name = model_name
        labels = [m.MODEL_NAME_LABEL, m.DISAGG_OUTCOME_LABEL]
        doc = "Prefill legs this engine ran, by outcome"
        self.legs = Counter(m.DISAGG_PREFILL_LEGS, doc, labels, registry=registry)
        self.seconds = Histogram(
            m.DISAGG_PREFILL_SECONDS, "Prefill legs that worked: sent until the KV is in the cachestore",
            [m.MODEL_NAME_LABEL], buckets=LEG_SECONDS_BUCKETS, registry=registry,
        )  # fmt: skip
        for outcome in OUTCOMES:  # zeros before the first leg
            self.legs.labels(model_name, outcome)
        self.seconds.labels(model_name)

    def target(self, value: str | None, request_id: str) -> str | None:
        """The prefiller's base URL when this engine may call it, else None (logged)."""
        if not value:
            return None
        if not self.decodes:
            log.info("request %s: %s ignored: a --role %s engine computes its prompts", request_id, PREFILLER_HEADER,
                     self.role)  # fmt: skip
            return None
        host, _, port = value.strip().rpartition(":")
        try:
            ip = ipaddress.ip_address(host.strip("[]"))
            ok = port.isdigit() and 0 < int(port) < 65536 and any(ip in net for net in self.allowed)
        except ValueError:
            ok = False
        if not ok:
            self.legs.labels(self.model_name, IGNORED).inc()
            log.warning("request %s: %s %r ignored: not an IP:PORT in --prefiller-allow; computing the prompt here",
                        request_id, PREFILLER_HEADER, value[:100])  # fmt: skip
            return None
        return f"http://{value.strip()}"

    async def run(self, request: Request, path: str, body: dict, max_model_len: int) -> int | None:
        """The prefill leg of `body` (the request's, parsed and checked), when the request names an allowed
        prefiller; returns once it ended, however it ended: the first token to start from, or None."""
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        url = self.target(request.headers.get(PREFILLER_HEADER), request_id)
        if url is None:
            return None
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        if parent := request.headers.get("traceparent"):
            headers["traceparent"] = parent
        raw = prefill_body(body)
        t0 = time.monotonic()
        try:
            async with httpx.AsyncClient(timeout=self.timeout) as client:
                resp = await client.post(url + path, content=raw, headers=prefill_headers(headers, request_id))
            outcome = leg_outcome(resp.status_code)
            why = f"HTTP {resp.status_code}"
        except httpx.HTTPError as exc:
            outcome, why = FAILED, type(exc).__name__
        self.legs.labels(self.model_name, outcome).inc()
        if outcome == OK:
            self.seconds.labels(self.model_name).observe(time.monotonic() - t0)
            return first_token(body, resp.content, max_model_len)
        log.warning("request %s: prefill leg on %s %s (%s): computing the prompt here", request_id, url, outcome,
                    why)  # fmt: skip
        return None
