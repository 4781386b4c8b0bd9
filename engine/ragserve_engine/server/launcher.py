"""Run `ragserve engine`: HTTP up at once, the model loads, compiles its decode graphs and calibrates in the
background, /ready once all are done, cluster duties once loaded.

SIGTERM drains: /ready turns false and new requests get 503, the engine deregisters from the
router, running requests finish (up to --drain-timeout), then the process exits 0. A second
signal exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import torch
import uvicorn
import zmq

from ragserve import tracing
from ragserve.engine_args import EngineConfig, ServerConfig
from ragserve.http.drain import DrainingServer
from ragserve.http.joined import server_config
from ragserve.logs import setup_logging
from ragserve.model_source import resolve_model
from ragserve.tls import uvicorn_tls
from ragserve_engine.engine_client import EngineClient
from ragserve_engine.server.engine_server import DRAINING, FAILED, EngineServer
from ragserve_engine.server.kv_events import KVEventLog
from ragserve_engine.server.routes import create_app

log = logging.getLogger("ragserve_engine.server")
DRAIN_POLL_S = 0.1
GRAPHS_POLL_S = 0.1
StartEngine = Callable[[EngineConfig], EngineClient]  # loads the model (on a worker thread), e.g. AsyncLLM


class EngineHTTPServer(DrainingServer):
    """Drain: deregister from the router, then wait for running requests (up to --drain-timeout)."""

    def __init__(self, config: uvicorn.Config, server: EngineServer) -> None:
        super().__init__(config)
        self.server = server

    def draining(self) -> bool:
        return self.server.status == DRAINING

    def begin_drain(self, reason: str) -> None:
        log.info("%s: draining (ready=false), then exiting", reason)
        self.server.status = DRAINING

    async def drain(self, reason: str) -> None:
        server = self.server
        if server.registration is not None:
            await server.registration.stop(reason)
        deadline = self.loop.time() + server.config.drain_timeout
        while server.busy and self.loop.time() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        if server.busy:
            log.warning("drain timeout: exiting with requests still running")


async def load(server: EngineServer, uv: EngineHTTPServer, start_engine: StartEngine) -> None:
    try:
        llm = await asyncio.to_thread(start_engine, server.engine_config)
    except Exception:
        log.exception("failed to load model %s", server.engine_config.model)
        server.status, uv.exit_code, uv.should_exit = FAILED, 1, True
        return
    try:
        await start_serving(server, llm)
    except Exception:  # a loaded engine that cannot serve exits non-zero, not "loading" forever
        log.exception("failed to start serving model %s", server.engine_config.model)
        llm.shutdown()
        server.status, uv.exit_code, uv.should_exit = FAILED, 1, True


async def start_serving(server: EngineServer, llm: EngineClient) -> None:
    """The loaded engine: its decode graphs and calibration, then ready (and registered with --router)."""
    if not server.embeds:
        await wait_for_graphs(server, llm)
    if server.status != DRAINING and not server.embeds:
        from ragserve_engine.server.calibration import calibrate

        await calibrate(llm)  # measured speeds in the first heartbeat; not ready until done
    if server.status == DRAINING:  # stopped while loading
        llm.shutdown()
        return
    server.attach(llm)
    info = llm.info
    log.info(
        "serving %s (model_id %s): %d KV blocks of %d tokens, max_model_len %d",
        server.model_name, info.layout.model_id, info.num_blocks, info.layout.block_size, info.max_model_len,
    )  # fmt: skip
    if server.config.router:
        from ragserve_engine.server.registration import RegistrationClient

        ec = server.engine_config
        server.registration = RegistrationClient(
            server.config, llm, server.model_name, KVEventLog(), ec.prefill_cap, ec.max_long_partial_prefills
        )
        server.registration.start()


async def wait_for_graphs(server: EngineServer, llm: EngineClient) -> None:
    """Not ready while a decode graph compiles (--compile-at-start): a request never waits for one, nor shares
    the cores with one. The compile thread logs each size; a drain stops the wait."""
    t0, stats = time.perf_counter(), llm.stats()
    if not stats.decode_graphs_pending:
        return
    log.info("compiling %d decode graphs before serving", stats.decode_graphs_pending)
    while server.status != DRAINING and (stats := llm.stats()).decode_graphs_pending:
        await asyncio.sleep(GRAPHS_POLL_S)
    log.info(
        "decode graphs ready in %.1f s: %d compiled, %d generated (the rest from the compile cache)",
        time.perf_counter() - t0, stats.decode_graphs_compiled, stats.decode_graph_cache_misses,
    )  # fmt: skip


def start_kv_publisher(server: EngineServer) -> None:
    """Bind the vLLM KV-event sockets before the model loads (a taken port fails the start at once)."""
    config = server.config.kv_events()
    if config is not None:
        from ragserve_engine.server.vllm_kv_events import VllmKVEventPublisher

        server.kv_publisher = VllmKVEventPublisher.start(config, bind=server.config.kv_events_bind)


async def run_server(server: EngineServer, start_engine: StartEngine) -> int:
    cfg = server.config
    try:
        start_kv_publisher(server)
    except zmq.ZMQError as exc:
        log.error("--kv-events-config: cannot open the KV-event sockets: %s", exc)
        tracing.shutdown()
        return 1
    tls = uvicorn_tls(cfg.tls_cert_file, cfg.tls_key_file, cfg.tls_client_ca_file)
    config = server_config(create_app(server), cfg.log_level, 30, tls, host=cfg.host, port=cfg.port)
    uv = EngineHTTPServer(config, server)
    loader = asyncio.create_task(load(server, uv, start_engine))
    try:
        await uv.serve()
    finally:
        await asyncio.gather(loader, return_exceptions=True)
        if server.registration is not None:
            await server.registration.stop("shutdown")
        if server.llm is not None:
            server.llm.shutdown()
        if server.kv_publisher is not None:  # after the engine's last step
            server.kv_publisher.close()
        tracing.shutdown()
    return uv.exit_code if uv.started else 1


def serve(engine_config: EngineConfig, cfg: ServerConfig, start_engine: StartEngine) -> int:
    setup_logging(cfg.log_level)
    tracing.setup(cfg.otlp_traces_endpoint, "ragserve-engine")
    source = resolve_model(engine_config.model, engine_config.served_model_name)  # bad names fail here
    server = EngineServer(cfg, engine_config, source.name)
    log.info(
        "engine %s: http %s:%d, model %s loading, %d torch threads",
        *(cfg.engine_id, cfg.host, cfg.port, source.name, torch.get_num_threads()),
    )
    return asyncio.run(run_server(server, start_engine))
