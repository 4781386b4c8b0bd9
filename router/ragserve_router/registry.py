"""Server side of proto/registry.proto: engines register, heartbeat, stream KV events, deregister."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from ragserve.router_args import RouterConfig
from ragserve.tls import server_credentials
from ragserve.token_auth import AioTokenAuth, read_token
from ragserve.v1 import registry_pb2, registry_pb2_grpc
from ragserve_router.admission import Refused, admit
from ragserve_router.engines import Load
from ragserve_router.metrics import RouterMetrics
from ragserve_router.pool import EnginePool
from ragserve_router.prompt import Tokenizers
from ragserve_router.state import RouterState, plan_events

log = logging.getLogger(__name__)
MISSED_HEARTBEATS = 3
UNAVAILABLE = "router state (Redis) is unavailable; retry"
REFUSED_MESSAGE = (
    "this router accepts no registrations: it needs --registry-token-file (and the engine the same token), "
    "mTLS (--tls-client-ca), or --registry-allow-unauthenticated"
)


def state_errors_unavailable(method):
    """A shared-state failure becomes UNAVAILABLE (engines retry), not an opaque UNKNOWN."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            log.warning("%s failed: %s", method.__name__, exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE, UNAVAILABLE)

    return wrapper


class RegistryServicer(registry_pb2_grpc.RegistryServicer):
    def __init__(
        self, cfg: RouterConfig, state: RouterState, pool: EnginePool, tokenizers: Tokenizers, metrics: RouterMetrics
    ) -> None:
        self.cfg = cfg
        self.state = state
        self.pool = pool
        self.tokenizers = tokenizers
        self.metrics = metrics
        self.ttl_s = MISSED_HEARTBEATS * cfg.heartbeat_interval_ms / 1000

    @state_errors_unavailable
    async def Register(self, request: registry_pb2.RegisterRequest, context) -> registry_pb2.RegisterResponse:
        live = await self.state.engines()
        try:
            admitted = await asyncio.to_thread(admit, request, live, self.tokenizers.cache)
        except Refused as refused:
            self.metrics.registrations_refused.labels(refused.reason).inc()
            log.error("registration refused (%s): %s", refused.reason, refused.message)
            code = grpc.StatusCode.INVALID_ARGUMENT if refused.invalid else grpc.StatusCode.FAILED_PRECONDITION
            await context.abort(code, refused.message)
        record = admitted.record
        self.tokenizers.add(record.tokenizer_fingerprint, admitted.tokenizer)
        seq = await self.state.register(record, admitted.blob, self.ttl_s)
        await self.pool.refresh()
        self.pool.health.pop(record.engine_id, None)
        self.metrics.registrations.inc()
        log.info(
            "engine %s registered: %s model=%s block_size=%d resume_from_seq=%d",
            record.engine_id,
            record.url,
            record.models[0],
            record.block_size,
            seq,
        )
        return registry_pb2.RegisterResponse(
            router_id=self.cfg.router_id, resume_from_seq=seq, heartbeat_interval_ms=self.cfg.heartbeat_interval_ms
        )

    @state_errors_unavailable
    async def Heartbeat(self, request: registry_pb2.HeartbeatRequest, context) -> registry_pb2.HeartbeatResponse:
        fields = {f.name: getattr(request.load, f.name) for f in dataclasses.fields(Load) if f.name != "reported_at"}
        load = Load(**fields, reported_at=time.time())
        known = await self.state.heartbeat(request.engine_id, load, self.ttl_s)
        for source, tokens in (("computed", load.computed_prompt_tokens), ("fetched", load.fetched_prompt_tokens)):
            self.metrics.engine_prompt_tokens.labels(request.engine_id, source).set(tokens)
        record = self.pool.registered.get(request.engine_id)
        if known and record is not None:
            record.load = load
        return registry_pb2.HeartbeatResponse(known=known)

    async def StreamKVEvents(self, request_iterator, context):
        try:
            async for ack in self._apply_batches(request_iterator, context):
                yield ack
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            log.warning("StreamKVEvents failed: %s", exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE, UNAVAILABLE)

    async def _apply_batches(self, request_iterator, context):
        async for batch in request_iterator:
            engine_id = batch.engine_id
            if not await self.state.is_registered(engine_id):
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION, f"engine {engine_id!r} is not registered: call Register first"
                )
            last = await self.state.last_seq(engine_id)
            ops, new_seq = plan_events(last, batch.events)
            if new_seq != last:
                await self.state.apply(engine_id, ops, new_seq)
                self.metrics.count_kv_ops(ops)
            yield registry_pb2.KVEventAck(acked_seq=new_seq)

    @state_errors_unavailable
    async def Deregister(self, request: registry_pb2.DeregisterRequest, context) -> registry_pb2.DeregisterResponse:
        if await self.state.drop(request.engine_id):
            log.info("engine %s deregistered: %s", request.engine_id, request.reason or "no reason given")
            self.metrics.engines_dropped.labels("deregister").inc()
        self.pool.health.pop(request.engine_id, None)
        await self.pool.refresh()
        return registry_pb2.DeregisterResponse()


def registry_auth(cfg: RouterConfig) -> list[grpc.aio.ServerInterceptor]:
    """Contract 3: a shared token, or mTLS, or registrations are refused unless explicitly allowed."""
    if cfg.registry_token_file:
        return [AioTokenAuth(read_token(cfg.registry_token_file))]
    if cfg.tls_client_ca or cfg.registry_allow_unauthenticated:
        return []
    log.warning("registry: no --registry-token-file and no mTLS (--tls-client-ca): every registration is refused")
    return [AioTokenAuth(None, REFUSED_MESSAGE)]


def build_grpc_server(
    cfg: RouterConfig, servicer: RegistryServicer
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """The registry server with message limits, optional (mutual) TLS and the standard health service."""
    limit = cfg.grpc_max_message_bytes
    server = grpc.aio.server(
        options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)],
        interceptors=registry_auth(cfg),
    )
    registry_pb2_grpc.add_RegistryServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{cfg.host}:{cfg.grpc_port}"
    if cfg.tls_cert:
        port = server.add_secure_port(address, server_credentials(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca))
    else:
        port = server.add_insecure_port(address)
    return server, port, health_servicer
