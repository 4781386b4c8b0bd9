"""Run the router: the HTTP gateway and the gRPC registry in one event loop, drained on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from urllib.parse import urlsplit

import uvicorn
from grpc_health.v1 import health_pb2

from ragserve import tracing
from ragserve.http.auth import ApiKeys
from ragserve.http.direct import direct_protocol
from ragserve.http.drain import DrainingServer
from ragserve.http.joined import server_config
from ragserve.logs import setup_logging
from ragserve.router_args import RouterConfig
from ragserve.tls import uvicorn_tls
from ragserve_router.app import Gateway, create_app
from ragserve_router.auth import RateLimiter, parse_keys_file
from ragserve_router.external import ExternalEngines, load_tokenizer
from ragserve_router.flow import FlowControl
from ragserve_router.gate import Gate
from ragserve_router.memory_state import MemoryState
from ragserve_router.metrics import RouterMetrics
from ragserve_router.policies import Decider
from ragserve_router.pool import EnginePool
from ragserve_router.prompt import Tokenizers
from ragserve_router.proxy import Proxy
from ragserve_router.quotas import Quota, Quotas, parse_quotas_file
from ragserve_router.registry import RegistryServicer, build_grpc_server
from ragserve_router.state import RouterState

log = logging.getLogger("ragserve_router")


def redacted(url: str) -> str:
    parts = urlsplit(url)
    return url.replace(parts.password, "***") if parts.password else url


async def make_state(cfg: RouterConfig) -> RouterState:
    if not cfg.redis:
        return MemoryState(cfg.approx_max_entries)
    from ragserve_router.redis_state import RedisState

    state = RedisState(cfg.redis, cfg.redis_prefix, cfg.approx_ttl, cfg.approx_max_entries)
    if not await state.ping():
        await state.close()
        raise ValueError(f"cannot reach Redis at {redacted(cfg.redis)}")
    return state


def external_engines(cfg: RouterConfig) -> ExternalEngines | None:
    """The --external-engine engines (and those --external-k8s-selector finds later), hashed with the
    --tokenizer (loaded now: a bad path fails the start)."""
    if not cfg.external_engine and not cfg.external_k8s_selector:
        return None
    assert cfg.tokenizer is not None  # RouterConfig requires it with --external-engine or --external-k8s-selector
    tokenizer = load_tokenizer(cfg.tokenizer)
    _ = tokenizer.tokenizer  # parse tokenizer.json now, not on the first request
    return ExternalEngines(cfg.external_engine, tokenizer, cfg.external_block_size)


def gate(cfg: RouterConfig, pool: EnginePool, metrics: RouterMetrics) -> Gate:
    """Tenant quotas and the router queue (a bad --tenant-quotas-file stops start-up)."""
    tenants = parse_quotas_file(cfg.tenant_quotas_file) if cfg.tenant_quotas_file else {}
    quotas = Quotas(Quota(cfg.tenant_tokens_per_minute, cfg.tenant_max_concurrent), tenants, metrics)

    def engines(model: str) -> int:
        return len(pool.candidates(model))

    flow = FlowControl(cfg.max_inflight_per_engine, cfg.queue_size, cfg.queue_timeout, metrics, engines,
                       reserve=cfg.critical_reserve_per_engine, fair_share=cfg.tenant_fair_share,
                       preempt=cfg.tenant_fair_share and cfg.engine_priority)  # fmt: skip
    return Gate(quotas, flow)


class RouterServer(DrainingServer):
    """Drain: report not ready and call on_drain, wait drain_delay (load balancers notice), then stop
    taking connections and let in-flight requests finish (up to drain_timeout)."""

    def __init__(self, config: uvicorn.Config, gateway: Gateway, on_drain: Callable[[], None]) -> None:
        super().__init__(config)
        self.gateway = gateway
        self.on_drain = on_drain

    def draining(self) -> bool:
        return self.gateway.draining

    def begin_drain(self, reason: str) -> None:
        log.info("signal %s: draining (ready=false), stopping in %.1f s", reason, self.gateway.cfg.drain_delay)
        self.gateway.draining = True

    async def drain(self, reason: str) -> None:
        self.on_drain()
        await asyncio.sleep(self.gateway.cfg.drain_delay)


async def serve(cfg: RouterConfig) -> int:
    setup_logging(cfg.log_level)
    tracing.setup(cfg.otlp_traces_endpoint, "ragserve-router")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per proxied request otherwise
    keys = parse_keys_file(cfg.api_keys_file) if cfg.api_keys_file else None
    if cfg.k8s_selector or cfg.external_k8s_selector:
        from ragserve_router.k8s import ExternalPodWatcher, PodWatcher, parse_selector

        for selector in filter(None, (cfg.k8s_selector, cfg.external_k8s_selector)):
            parse_selector(selector)  # a bad selector stops start-up with a clear error
    external = external_engines(cfg)  # a bad --tokenizer stops start-up
    state = await make_state(cfg)
    metrics = RouterMetrics()
    pool = EnginePool(cfg, state, metrics, external)
    tokenizers = Tokenizers(state)
    metrics.watch_token_caches(lambda: [t.cache for t in list(tokenizers.cache.values())])
    if external:
        tokenizers.add(external.spec.tokenizer_fingerprint, external.tokenizer)
    gateway = Gateway(
        cfg=cfg,
        state=state,
        pool=pool,
        tokenizers=tokenizers,
        decider=Decider(
            cfg,
            state,
            pool.load,
            pool.kv_usage,
            pool.queued_prefill,
            pool.routed_blocks,
            pool.queued_prompts,
            pool.exact_index,
            pool.offload_tiers,
            pool.held_blocks,
            pool.pending_blocks,
        ),
        proxy=Proxy(cfg, pool, metrics),
        auth=ApiKeys(keys),
        limiter=RateLimiter(cfg.rate_limit_rps, cfg.rate_limit_burst),
        metrics=metrics,
        gate=gate(cfg, pool, metrics),
    )
    grpc_server, grpc_port, grpc_health = build_grpc_server(
        cfg, RegistryServicer(cfg, state, pool, tokenizers, metrics)
    )
    await grpc_server.start()
    await grpc_health.set("", health_pb2.HealthCheckResponse.SERVING)
    await pool.refresh()
    await pool.probe_due()
    tasks = [asyncio.create_task(pool.run())]
    if external:
        external.start(state, metrics.count_kv_ops)
    if cfg.k8s_selector:
        tasks.append(asyncio.create_task(PodWatcher(cfg, pool).run()))
    if cfg.external_k8s_selector:
        assert external is not None
        tasks.append(asyncio.create_task(ExternalPodWatcher(cfg, pool, external).run()))

    picker = None
    if cfg.epp_port:
        from ragserve_router.epp.server import EndpointPicker

        picker = EndpointPicker(gateway, gateway.auth, gateway.admit)
        await picker.start()
        log.info("endpoint picker (ext_proc) on %s:%d, %s", cfg.host, picker.port, "TLS" if picker.tls else "plaintext")

    def on_drain() -> None:
        asyncio.ensure_future(grpc_health.enter_graceful_shutdown())  # the EPP's readiness follows gateway.draining

    tls = uvicorn_tls(cfg.tls_cert_file, cfg.tls_key_file)
    app, direct = create_app(gateway)
    http = direct_protocol(direct)
    config = server_config(app, cfg.log_level, cfg.drain_timeout, tls, http, host=cfg.host, port=cfg.port)
    server = RouterServer(config, gateway, on_drain)
    log.info(
        "router %s: %s %s:%d, grpc registry %s:%d, policy %s, state %s",
        cfg.router_id,
        "https" if cfg.tls_cert_file else "http",
        cfg.host,
        cfg.port,
        cfg.host,
        grpc_port,
        cfg.policy,
        "redis" if cfg.redis else "memory",
    )
    try:
        await server.serve()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if external:
            await external.stop()
        await grpc_server.stop(grace=1.0)
        if picker is not None:
            await picker.stop(grace=1.0)
        for closer in (gateway.proxy.close, pool.close, state.close):
            with contextlib.suppress(Exception):
                await closer()
        gateway.decider.store.close()  # the cachestore lookup channels
        tracing.shutdown()
    return 0 if server.started else 1
