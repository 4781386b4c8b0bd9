"""The endpoint picker's gRPC server: Envoy's ExternalProcessor (full-duplex streamed, one stream per HTTP request)
and gRPC health for `liveness`, `readiness` and the ExternalProcessor service, with TLS and message limits."""

from __future__ import annotations

import asyncio
import logging

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ragserve.http.auth import ApiKeys
from ragserve_router.epp import certs, protocol
from ragserve_router.epp.exchange import Admit, Exchange
from ragserve_router.routing import Routing

log = logging.getLogger(__name__)
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
READY_SERVICES = ("readiness", protocol.SERVICE)
READINESS_INTERVAL = 0.25  # seconds between readiness updates (engines come and go, SIGTERM drains)


class Picker(external_processor_pb2_grpc.ExternalProcessorServicer):
    def __init__(self, routing: Routing, auth: ApiKeys, admit: Admit | None = None) -> None:
        self.routing, self.auth, self.admit = routing, auth, admit

    async def Process(self, request_iterator, context: grpc.aio.ServicerContext) -> None:  # noqa: N802 (gRPC's name)
        """One HTTP request: answer each message in order; whatever ends the stream, its slot is released."""
        exchange = Exchange(self.routing, self.auth, self.admit)
        try:
            while not exchange.refused:  # after an immediate response the gateway sends nothing more
                req = await context.read()
                if req is grpc.aio.EOF:
                    return
                for answer in await exchange.handle(req):
                    await context.write(answer)
        finally:
            exchange.close()


class EndpointPicker:
    """The server and its readiness: serving while an engine is healthy and the router is not draining."""

    def __init__(self, routing: Routing, auth: ApiKeys, admit: Admit | None = None) -> None:
        cfg = routing.cfg
        self.routing = routing
        limit = cfg.grpc_max_message_bytes
        self.server = grpc.aio.server(
            options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]
        )
        external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(Picker(routing, auth, admit), self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        address = f"{cfg.host}:{cfg.epp_port}"
        creds = certs.credentials(cfg)
        self.port = self.server.add_secure_port(address, creds) if creds else self.server.add_insecure_port(address)
        self.tls = creds is not None
        self._ready: bool | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        await self.health.set("liveness", SERVING)
        await self.update()
        await self.server.start()
        self._task = asyncio.create_task(self._watch())

    def ready(self) -> bool:
        return not self.routing.draining and bool(self.routing.pool.healthy())

    async def update(self) -> None:
        ready = self.ready()
        if ready != self._ready:
            self._ready = ready
            for service in READY_SERVICES:
                await self.health.set(service, SERVING if ready else NOT_SERVING)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(READINESS_INTERVAL)
            await self.update()

    async def stop(self, grace: float) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.server.stop(grace=grace)
