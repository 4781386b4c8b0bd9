"""Assemble and run a cachestore: tiers, gRPC service (+ health, reflection), TLS, auth, /metrics."""

from __future__ import annotations

import logging
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ragserve.cachestore_args import CacheStoreConfig
from ragserve.tls import server_credentials
from ragserve.token_auth import read_token
from ragserve.v1 import cachestore_pb2 as pb
from ragserve.v1 import cachestore_pb2_grpc as pb_grpc
from ragserve_cachestore.auth import TokenAuthInterceptor
from ragserve_cachestore.metrics import serve_metrics
from ragserve_cachestore.service import CacheStoreServicer, Limits
from ragserve_cachestore.store import TieredStore
from ragserve_cachestore.tiers.disk import DiskTier
from ragserve_cachestore.tiers.memory import MemoryTier

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["CacheStore"].full_name


def build_store(config: CacheStoreConfig) -> TieredStore:
    tiers = [MemoryTier(config.memory)]
    if config.disk_dir:
        tiers.append(DiskTier(config.disk_dir, config.disk))
    if config.redis:
        from ragserve_cachestore.tiers.redis_tier import RedisTier

        tiers.append(RedisTier(config.redis, config.redis_capacity, config.redis_prefix))
    return TieredStore(tiers)


class CacheStoreServer:
    """`start()` binds and serves (returns the bound port); `stop()` shuts everything down."""

    def __init__(self, config: CacheStoreConfig) -> None:
        self.config = config
        self.store = build_store(config)
        self.port: int | None = None
        self._health = health.HealthServicer(experimental_non_blocking=True)
        self._metrics = None
        self._server = self._build_server()

    def _build_server(self) -> grpc.Server:
        c = self.config
        interceptors = [TokenAuthInterceptor(read_token(c.auth_token_file))] if c.auth_token_file else []
        options = [
            ("grpc.max_receive_message_length", c.max_message_bytes),
            ("grpc.max_send_message_length", c.max_message_bytes),
            ("grpc.so_reuseport", 0),  # a taken port is an error, not a silently shared one
        ]
        server = grpc.server(futures.ThreadPoolExecutor(c.workers), interceptors=interceptors, options=options)
        pb_grpc.add_CacheStoreServicer_to_server(CacheStoreServicer(self.store, Limits(c.max_blocks_per_call)), server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        names = (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
        return server

    def start(self) -> int:
        c = self.config
        address = f"[{c.host}]:{c.port}" if ":" in c.host else f"{c.host}:{c.port}"
        creds = server_credentials(c.tls_cert, c.tls_key, c.tls_client_ca) if c.tls_cert else None
        try:
            port = self._server.add_secure_port(address, creds) if creds else self._server.add_insecure_port(address)
        except RuntimeError as exc:
            raise ValueError(f"cannot listen on {address}: {exc}") from None
        if not port:
            raise ValueError(f"cannot listen on {address}")
        if c.metrics_port:
            self._metrics = serve_metrics(self.store, c.host, c.metrics_port)
        self._server.start()
        for service in ("", SERVICE_NAME):
            self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self.port = port
        tiers = ", ".join(f"{t.name} {t.index.capacity} B" for t in self.store.tiers)
        log.info("cachestore on %s:%d (%s; tls=%s, auth=%s)", c.host, port, tiers, bool(creds), bool(c.auth_token_file))
        return port

    def stop(self, grace: float | None = 1.0) -> None:
        self._health.enter_graceful_shutdown()
        self._server.stop(grace).wait()
        if self._metrics is not None:
            self._metrics.shutdown()
            self._metrics.server_close()
            self._metrics = None

    def wait(self, timeout: float | None = None) -> bool:
        return self._server.wait_for_termination(timeout)
