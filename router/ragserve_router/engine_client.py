"""The router's HTTP/1.1 client to engines: a keep-alive connection pool per engine, on asyncio protocols.

Every request to an engine (the proxied ones and prefill legs) is a POST whose body is in hand and whose answer
is relayed as it comes. The request goes out in one write; of the answer only the status line and headers are
parsed, the body's bytes are handed on as they arrive (chunked framing taken off). It replaced httpx/httpcore
here, whose per-request layers were about a quarter of the router's CPU per request
(bench/results/profile-router-hop-*.txt). Each engine origin has its own pool, so a request only looks at its
engine's connections; a pool with no open response and no request for KEEPALIVE_EXPIRY_S is closed when
another origin's pool is made (engines come and go).

Failures raise httpx's exceptions, which the callers sort (upstream.py, relay.py, proxy.py, disagg.py):
ConnectError / ConnectTimeout (nothing sent), ReadTimeout (--upstream-timeout without a byte), RemoteProtocolError
(the engine closed the connection or did not speak HTTP/1.1), PoolTimeout (MAX_CONNECTIONS open to one engine).
A pooled connection the engine closed while idle (its keep-alive timeout) is dropped; one it closes just as a
request is written, answering nothing, gets the request once more on a new connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from dataclasses import dataclass, field
from functools import lru_cache
from urllib.parse import urlsplit

import httpx

from ragserve.router_args import RouterConfig
from ragserve_router.engine_tls import engine_verify
from ragserve_router.engine_wire import Body, Conn

MAX_CONNECTIONS = 2048  # per engine
MAX_KEEPALIVE = 256  # idle connections kept per engine
KEEPALIVE_EXPIRY_S = 30.0
HEAD_LIMIT = 64 * 1024  # bytes of status line and headers

Origin = tuple[str, str, int]  # scheme, host, port


@dataclass(frozen=True)
class Target:
    origin: Origin
    path: str
    host_header: str


@dataclass(eq=False)
class Pool:
    idle: list[Conn] = field(default_factory=list)
    active: int = 0  # connections lent to a response not closed yet
    used: float = 0.0  # monotonic time of its last request

    def take_idle(self) -> Conn | None:
        """The most recently used idle connection still open (older ones past the keep-alive time are closed)."""
        cutoff = time.monotonic() - KEEPALIVE_EXPIRY_S
        while self.idle:
            conn = self.idle.pop()
            if conn.reusable(cutoff):
                return conn
            conn.close()
        return None

    def give_back(self, conn: Conn) -> None:
        if len(self.idle) < MAX_KEEPALIVE and conn.reusable(0.0):
            conn.idle_since = time.monotonic()
            self.idle.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        idle, self.idle = self.idle, []
        for conn in idle:
            conn.close()


class EngineResponse:
    """status_code and headers (lowercase names) at once; the body by aiter_raw() or aread(); aclose() always."""

    def __init__(self, conn: Conn, pool: Pool, status: int, headers: dict[str, str], body: Body) -> None:
        self.conn, self.pool, self.status_code, self.headers, self.body = conn, pool, status, headers, body
        self.open = True

    async def aiter_raw(self):
        while True:
            data = self.body.take(self.conn)
            if data:
                yield data
            elif self.body.done:
                self._release()
                return
            else:
                await self.conn.fill()

    async def aread(self) -> bytes:
        return b"".join([data async for data in self.aiter_raw()])

    def _release(self) -> None:
        if self.open:
            self.open = False
            self.pool.active -= 1
            if self.body.done and self.body.keep_alive:
                self.pool.give_back(self.conn)
            else:
                self.conn.close()

    async def aclose(self) -> None:
        if self.open and not self.body.done:
            with contextlib.suppress(httpx.HTTPError):
                self.body.take(self.conn)  # what is buffered may end it (a stream's last chunk after [DONE])
        self._release()


class EngineHTTP:
    def __init__(self, cfg: RouterConfig) -> None:
        self.read_timeout, self.connect_timeout = cfg.upstream_timeout, cfg.connect_timeout
        self.verify = engine_verify(cfg)  # the engines' CA and the router's client certificate, or True
        self.pools: dict[Origin, Pool] = {}

    async def post(self, url: str, headers: dict[str, str], body: bytes) -> EngineResponse:
        target = _target(url)
        pool = self.pools.get(target.origin) or self._new_pool(target.origin)
        if pool.active >= MAX_CONNECTIONS:
            raise httpx.PoolTimeout(f"{MAX_CONNECTIONS} connections open to {url}")
        pool.used = time.monotonic()
        request = _head(target, headers, len(body)) + body
        pool.active += 1
        try:
            conn = pool.take_idle()
            if conn is not None:
                try:
                    return await self._exchange(conn, pool, request)
                except httpx.RemoteProtocolError:
                    if conn.answered:
                        raise
                    # closed by the engine as the request went out, nothing answered: once more, on a new one
            return await self._exchange(await self._connect(target, pool), pool, request)
        except BaseException:
            pool.active -= 1
            raise

    async def _exchange(self, conn: Conn, pool: Pool, request: bytes) -> EngineResponse:
        try:
            conn.send(request)
            status, headers = await conn.read_head(HEAD_LIMIT)
            return EngineResponse(conn, pool, status, headers, Body.framing(status, headers))
        except BaseException:
            conn.close()
            raise

    async def _connect(self, target: Target, pool: Pool) -> Conn:
        scheme, host, port = target.origin
        tls = self._ssl() if scheme == "https" else None
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: Conn(pool.idle, self.read_timeout), host, port, ssl=tls, server_hostname=tls and host
                )
        except TimeoutError:
            raise httpx.ConnectTimeout(f"connecting to {scheme}://{host}:{port} timed out") from None
        except OSError as exc:
            raise httpx.ConnectError(f"connecting to {scheme}://{host}:{port}: {exc}") from None
        return conn

    def _ssl(self) -> ssl.SSLContext:
        if self.verify is True:
            self.verify = ssl.create_default_context()
        return self.verify

    def _new_pool(self, origin: Origin) -> Pool:
        cutoff = time.monotonic() - KEEPALIVE_EXPIRY_S
        for gone in [o for o, p in self.pools.items() if not p.active and p.used < cutoff]:
            self.pools.pop(gone).close()
        pool = self.pools[origin] = Pool()
        return pool

    async def aclose(self) -> None:
        pools, self.pools = list(self.pools.values()), {}
        for pool in pools:
            pool.close()


@lru_cache(maxsize=4096)
def _target(url: str) -> Target:
    """Parsed once per engine and path."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise httpx.UnsupportedProtocol(f"not an http(s) URL: {url}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return Target((parts.scheme, parts.hostname, port), path, parts.netloc.rpartition("@")[2])


def _head(target: Target, headers: dict[str, str], length: int) -> bytes:
    lines = [f"POST {target.path} HTTP/1.1\r\nHost: {target.host_header}\r\nContent-Length: {length}\r\n"]
    for name, value in headers.items():
        if "\n" in value or "\r" in value:
            raise httpx.LocalProtocolError(f"header {name}: a line break in its value")
        lines.append(f"{name}: {value}\r\n")
    lines.append("\r\n")
    return "".join(lines).encode("latin-1")
