"""The HTTP client the router sends requests to engines with: one connection pool per engine.

httpcore's pool scans every pooled connection on each request and each response's end (which one is idle,
which expired); one pool for the whole fleet made that O(connections), hundreds at 256 engines. Here each
engine origin (scheme, host, port) gets its own transport and pool, so a request only looks at its engine's
connections. Transports are made in one place (`_transport`), where connection options such as TLS go.
"""

from __future__ import annotations

import ssl
import time
from dataclasses import dataclass
from functools import lru_cache

import httpx

from ragserve.router_args import RouterConfig
from ragserve_router.engine_tls import engine_verify

MAX_CONNECTIONS = 2048  # per engine
MAX_KEEPALIVE = 256  # per engine
KEEPALIVE_EXPIRY_S = 30.0


Origin = tuple[bytes, bytes, int | None]


@dataclass
class _Pool:
    transport: httpx.AsyncHTTPTransport
    active: int = 0  # responses not closed yet
    used: float = 0.0  # monotonic time of its last request


class _Body(httpx.AsyncByteStream):
    """A response body that tells its pool when it is closed."""

    def __init__(self, stream: httpx.AsyncByteStream, pool: _Pool) -> None:
        self.stream, self.pool, self.open = stream, pool, True

    async def __aiter__(self):
        async for chunk in self.stream:
            yield chunk

    async def aclose(self) -> None:
        if self.open:
            self.open = False
            self.pool.active -= 1
        await self.stream.aclose()


class PerEngineTransport(httpx.AsyncBaseTransport):
    """Dispatches each request to its origin's own pool. A pool with no open response and no request for
    KEEPALIVE_EXPIRY_S is closed when another origin's pool is made (engines come and go: their idle sockets
    must not pile up)."""

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.verify = engine_verify(cfg)  # one SSL context (the engines' CA, the router's client certificate)
        self.pools: dict[Origin, _Pool] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        origin = (url.raw_scheme, url.raw_host, url.port)
        pool = self.pools.get(origin)
        if pool is None:
            await self._close_unused()
            pool = self.pools[origin] = _Pool(_transport(self.verify))
        pool.used = time.monotonic()
        pool.active += 1
        try:
            resp = await pool.transport.handle_async_request(request)
        except BaseException:
            pool.active -= 1
            raise
        resp.stream = _Body(resp.stream, pool)
        return resp

    async def post(self, url: str, headers: dict[str, str], body: bytes, timeout: httpx.Timeout) -> httpx.Response:
        """A POST with a streamed answer straight to its engine's pool, past httpx.AsyncClient's per-request layers
        (URL merging, default headers, cookies, auth, redirects: none of them used for engines)."""
        request = httpx.Request(
            "POST", _url(url), headers=headers, content=body, extensions={"timeout": timeout.as_dict()}
        )
        response = await self.handle_async_request(request)
        response.request = request
        return response

    async def _close_unused(self) -> None:
        cutoff = time.monotonic() - KEEPALIVE_EXPIRY_S
        for origin in [o for o, p in self.pools.items() if not p.active and p.used < cutoff]:
            await self.pools.pop(origin).transport.aclose()

    async def aclose(self) -> None:
        pools, self.pools = list(self.pools.values()), {}
        for pool in pools:
            await pool.transport.aclose()


@lru_cache(maxsize=4096)
def _url(url: str) -> httpx.URL:
    return httpx.URL(url)  # parsed once per engine and path


def _transport(verify: ssl.SSLContext | bool) -> httpx.AsyncHTTPTransport:
    limits = httpx.Limits(
        max_connections=MAX_CONNECTIONS, max_keepalive_connections=MAX_KEEPALIVE, keepalive_expiry=KEEPALIVE_EXPIRY_S
    )
    return httpx.AsyncHTTPTransport(limits=limits, verify=verify)


def engine_http_client(cfg: RouterConfig, transport: PerEngineTransport | None = None) -> httpx.AsyncClient:
    """The client for requests to engines (upstream.py): per-engine pools, the router's timeouts."""
    timeout = httpx.Timeout(cfg.upstream_timeout, connect=cfg.connect_timeout)
    return httpx.AsyncClient(timeout=timeout, transport=transport or PerEngineTransport(cfg))
