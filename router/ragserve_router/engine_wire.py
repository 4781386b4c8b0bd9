"""HTTP/1.1 on the wire for engine_client.py: one connection (an asyncio protocol) and a response body's framing.

The connection buffers what arrives and pauses reading past HIGH_WATER bytes until the reader takes them (a
client slower than its engine holds the engine back, not the router's memory).
"""

from __future__ import annotations

import asyncio

import httpx

HIGH_WATER = 256 * 1024
NO_BODY = (204, 304)
CHUNK_LINE_LIMIT = 4096


def _expire(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_exception(httpx.ReadTimeout("the engine sent nothing for --upstream-timeout"))


class Conn(asyncio.Protocol):
    def __init__(self, idle: list[Conn], read_timeout: float) -> None:
        self.idle, self.read_timeout = idle, read_timeout  # idle: its pool's idle list (left when the peer closes)
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future | None = None
        self.closed = False  # the peer closed it, or we did: never reused
        self.paused = False
        self.answered = False  # a byte arrived since the last request went out
        self.idle_since = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self.answered = True
        if len(self.buf) > HIGH_WATER and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.closed = True
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._wake()
        if self in self.idle:
            self.idle.remove(self)

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def reusable(self, idle_after: float) -> bool:
        """Open, nothing unread, idle since idle_after or later."""
        return not self.closed and not self.buf and self.idle_since >= idle_after and not self.transport.is_closing()

    def send(self, data: bytes) -> None:
        self.answered = False
        self.transport.write(data)

    async def fill(self) -> None:
        """Wait for more bytes: RemoteProtocolError when the peer closed, ReadTimeout after the read timeout."""
        if self.closed:
            raise httpx.RemoteProtocolError("the engine closed the connection before the answer's end")
        if self.paused:
            self.paused = False
            self.transport.resume_reading()
        loop = asyncio.get_running_loop()
        self.waiter = fut = loop.create_future()
        timer = loop.call_later(self.read_timeout, _expire, fut)
        try:
            await fut
        finally:
            timer.cancel()
            self.waiter = None

    async def read_head(self, limit: int) -> tuple[int, dict[str, str]]:
        while (end := self.buf.find(b"\r\n\r\n")) < 0:
            if len(self.buf) > limit:
                raise httpx.RemoteProtocolError(f"the engine's answer has over {limit} bytes of headers")
            await self.fill()
        raw = bytes(self.buf[:end])
        del self.buf[: end + 4]
        return parse_head(raw)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


def parse_head(raw: bytes) -> tuple[int, dict[str, str]]:
    """Status and headers (lowercase names, repeated ones joined with ', ') of an HTTP/1.1 answer."""
    status_line, *lines = raw.decode("latin-1").split("\r\n")
    version, _, rest = status_line.partition(" ")
    code = rest[:3]
    if version != "HTTP/1.1" or not code.isdigit():
        raise httpx.RemoteProtocolError(f"not an HTTP/1.1 answer: {status_line[:80]!r}")
    headers: dict[str, str] = {}
    for line in lines:
        name, sep, value = line.partition(":")
        if not sep:
            raise httpx.RemoteProtocolError(f"bad header line: {line[:80]!r}")
        name, value = name.strip().lower(), value.strip()
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    return int(code), headers


class Body:
    """How much of the answer is its body: Content-Length, chunked, or up to the connection's end."""

    def __init__(self, length: int | None, chunked: bool, keep_alive: bool) -> None:
        self.left = length  # bytes (of the whole body, or of the current chunk when chunked)
        self.chunked = chunked
        self.state = "size" if chunked else "data"  # chunked: size -> data -> crlf -> size ... -> trailer
        self.keep_alive = keep_alive and (length is not None or chunked)
        self.done = length == 0 and not chunked

    @classmethod
    def framing(cls, status: int, headers: dict[str, str]) -> Body:
        keep_alive = "close" not in headers.get("connection", "").lower()
        if status in NO_BODY or status < 200:
            return cls(0, False, keep_alive)
        if "chunked" in headers.get("transfer-encoding", "").lower():
            return cls(None, True, keep_alive)
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise httpx.RemoteProtocolError(f"bad Content-Length: {length[:40]!r}")
            return cls(int(length), False, keep_alive)
        return cls(None, False, False)

    def take(self, conn: Conn) -> bytes:
        """The body's bytes buffered on conn (b"" when none yet, or done)."""
        buf = conn.buf
        if self.chunked:
            return self._chunks(buf)
        if self.left is None:  # up to the end of the connection
            self.done = conn.closed
            data = bytes(buf)
            buf.clear()
            return data
        data = bytes(buf[: self.left])
        del buf[: len(data)]
        self.left -= len(data)
        self.done = self.left == 0
        return data

    def _chunks(self, buf: bytearray) -> bytes:
        out = []
        while not self.done:
            if self.state == "data":
                data = bytes(buf[: self.left])
                del buf[: len(data)]
                self.left -= len(data)
                if data:
                    out.append(data)
                if self.left:
                    break
                self.state = "crlf"
            elif self.state == "crlf":
                if len(buf) < 2:
                    break
                if buf[:2] != b"\r\n":
                    raise httpx.RemoteProtocolError("a chunk not ended by CRLF")
                del buf[:2]
                self.state = "size"
            elif self.state == "size":
                if (end := self._line(buf)) < 0:
                    break
                size = bytes(buf[:end]).split(b";", 1)[0].strip()
                del buf[: end + 2]
                try:
                    self.left = int(size, 16)
                except ValueError:
                    raise httpx.RemoteProtocolError(f"bad chunk size {size[:20]!r}") from None
                self.state = "data" if self.left else "trailer"
            else:  # trailer lines until an empty one
                if (end := self._line(buf)) < 0:
                    break
                del buf[: end + 2]
                self.done = end == 0
        return b"".join(out)

    @staticmethod
    def _line(buf: bytearray) -> int:
        end = buf.find(b"\r\n")
        if end < 0 and len(buf) > CHUNK_LINE_LIMIT:
            raise httpx.RemoteProtocolError("a chunk size or trailer line too long")
        return end
