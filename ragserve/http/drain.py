"""uvicorn with a graceful drain on SIGTERM/SIGINT.

First signal: `begin_drain` (at once, in the signal handler: report not ready), then `drain` on the event
loop (deregister, wait for in-flight work); when it returns, uvicorn stops taking connections and lets open
requests finish (up to the config's timeout_graceful_shutdown). A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import signal
import socket

import uvicorn


class DrainingServer(uvicorn.Server):
    """Components subclass it and fill in the three hooks; `exit_code` is theirs to set."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.exit_code = 0
        self._draining = False

    def draining(self) -> bool:
        return self._draining

    def begin_drain(self, reason: str) -> None:
        self._draining = True

    async def drain(self, reason: str) -> None:
        """Wait until the process may stop; the default stops at once."""

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if self.draining() or self.loop is None:
            self.force_exit = self.should_exit
            self.should_exit = True
            return
        reason = signal.Signals(sig).name
        self.begin_drain(reason)
        self.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain(reason)))

    async def _drain(self, reason: str) -> None:
        try:
            await self.drain(reason)
        finally:
            self.should_exit = True
