"""The simulated engines of one `ragserve sim-engine` process: each an EngineServer (the real engine's routes,
metrics and registration) over a SimEngine, all on one event loop.

One uvicorn server listens on every engine's socket and hands each connection to the app of the local port it
came in on, so 256 engines cost one accept loop, not 256. SIGTERM deregisters every engine, then exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
from dataclasses import dataclass, replace

import uvicorn
from fastapi import FastAPI

from ragserve.engine_args import EngineConfig, ServerConfig
from ragserve.http.joined import server_config
from ragserve.keys import KVLayout
from ragserve.model_source import ModelSource, load_tokenizer, model_fingerprint, model_metadata, resolve_model
from ragserve.tls import uvicorn_tls
from ragserve.tokenizer import PromptTokenizer
from ragserve_engine.server.engine_server import EngineServer
from ragserve_engine.server.kv_events import KVEventLog
from ragserve_engine.server.registration import RegistrationClient
from ragserve_engine.server.routes import create_app
from ragserve_engine.sim.config import SimConfig
from ragserve_engine.sim.engine import SimCost, SimEngine

log = logging.getLogger("ragserve_engine.sim")


def kv_layout(source: ModelSource, block_size: int) -> KVLayout:
    """The layout a real engine of this model would report (model_id from the weights, shape from metadata)."""
    meta = model_metadata(source)
    head_dim = meta["hidden_size"] // meta["num_heads"]
    return KVLayout(
        model_fingerprint(source), "float32", block_size, meta["num_layers"], meta["num_kv_heads"], head_dim
    )


@dataclass
class SimMember:
    server: EngineServer
    engine: SimEngine
    app: FastAPI

    @classmethod
    def create(cls, sim: SimConfig, cfg: ServerConfig, ec: EngineConfig, layout: KVLayout, tok: PromptTokenizer):
        cost = SimCost(sim.prefill_tokens_per_s, sim.decode_base_s, sim.decode_seq_s)
        engine = SimEngine(tok, layout, ec.num_gpu_blocks, cost, ec.max_model_len, ec.max_num_seqs,
                           ec.max_num_batched_tokens, ec.prefill_cap, ec.max_long_partial_prefills)  # fmt: skip
        server = EngineServer(cfg, ec, ec.served_model_name or ec.model)
        return cls(server, engine, create_app(server))

    def start(self) -> None:
        """Loaded at once: serve, and register with the router (if any)."""
        self.server.attach(self.engine)
        if self.server.config.router:
            engine = self.engine
            self.server.registration = RegistrationClient(
                self.server.config, engine, self.server.model_name, KVEventLog(),
                engine.long_prefill_token_threshold, engine.max_long_partial_prefills,
            )  # fmt: skip
            self.server.registration.start()

    async def stop(self, reason: str) -> None:
        if self.server.registration is not None:
            await self.server.registration.stop(reason)
        self.engine.shutdown()


class PortDispatch:
    """One ASGI app for many sockets: each connection goes to the app of the local port it arrived on."""

    def __init__(self, apps: dict[int, FastAPI]) -> None:
        self.apps = apps

    async def __call__(self, scope, receive, send) -> None:
        await self.apps[scope["server"][1]](scope, receive, send)


class FleetHTTPServer(uvicorn.Server):
    """uvicorn without its own signal capture: the fleet's handler deregisters every engine first."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def bind(host: str, port: int) -> socket.socket:
    # proto IPPROTO_TCP: asyncio sets TCP_NODELAY on accepted connections only then (proto 0 left Nagle on, and
    # uvicorn's two writes, headers then body, waited for a delayed ACK: 40 ms on a busy keep-alive connection)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def write_urls(path: str, members: list[SimMember]) -> None:
    urls = {m.server.config.engine_id: m.server.config.url for m in members}
    with open(path + ".tmp", "w") as f:
        json.dump(urls, f)
    os.replace(path + ".tmp", path)


async def serve(sim: SimConfig, server_cfg: ServerConfig, engine_cfg: EngineConfig) -> int:
    source = resolve_model(engine_cfg.model, engine_cfg.served_model_name)
    engine_cfg = replace(engine_cfg, served_model_name=source.name)
    tok, layout = load_tokenizer(source), kv_layout(source, engine_cfg.block_size)
    socks = [bind(server_cfg.host, 0 if sim.free_ports else server_cfg.port + i) for i in range(sim.count)]
    members = []
    for i, sock in enumerate(socks):
        port = sock.getsockname()[1]
        engine_id = f"{server_cfg.engine_id}-{i}" if sim.count > 1 else server_cfg.engine_id
        advertise = server_cfg.advertise_url.format(port=port) if server_cfg.advertise_url else None
        cfg = replace(server_cfg, port=port, engine_id=engine_id, advertise_url=advertise)
        members.append(SimMember.create(sim, cfg, engine_cfg, layout, tok))
    app = PortDispatch({m.server.config.port: m.app for m in members})
    tls = uvicorn_tls(server_cfg.tls_cert_file, server_cfg.tls_key_file, server_cfg.tls_client_ca_file)
    uv = FleetHTTPServer(server_config(app, server_cfg.log_level, 5, tls))
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stopping.set)
    http = asyncio.create_task(uv.serve(sockets=socks))
    while not uv.started and not http.done():
        await asyncio.sleep(0.01)
    for m in members:
        m.start()
    if sim.urls_file:
        write_urls(sim.urls_file, members)
    log.warning("%d simulated engines of %s on ports %d..%d", len(members), source.name,
                members[0].server.config.port, members[-1].server.config.port)  # fmt: skip
    stop = asyncio.create_task(stopping.wait())
    await asyncio.wait([http, stop], return_when=asyncio.FIRST_COMPLETED)
    await asyncio.gather(*(m.stop("shutdown") for m in members))
    uv.should_exit = True
    await http
    stop.cancel()
    return 0 if uv.started else 1
