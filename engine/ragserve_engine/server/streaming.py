"""Server-sent events: text deltas that never take back what was sent, and a response that aborts on disconnect."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Awaitable, Callable

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ragserve_engine.engine_client import CompletionOutput


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


class ChoiceCursor:
    """What of one choice's text, tokens and logprobs has been streamed so far.

    The engine's text is that of all output tokens so far: a trailing incomplete UTF-8 character
    or the start of a stop string may still change, so they are held back until final.

    A resumed request (migration) starts where the interrupted stream stopped sending: the
    text of its resumed tokens less what was still held back, which it sends first.
    """

    def __init__(self, holdback: int, resumed_text: str = "") -> None:
        self.holdback = holdback
        self.text = self._visible(resumed_text, "")
        self.num_tokens = 0

    def _visible(self, text: str, sent: str) -> str:
        text = text.rstrip("\ufffd")
        return text[: max(len(sent), len(text) - self.holdback)]

    def advance(self, out: CompletionOutput) -> tuple[str, list[int], list[dict[int, float]]]:
        text = out.text
        if not out.finished:
            text = self._visible(text, self.text)
        delta = text[len(self.text) :] if text.startswith(self.text) else ""
        self.text += delta
        tokens = out.token_ids[self.num_tokens :]
        logprobs = (out.logprobs or [])[self.num_tokens :]
        self.num_tokens = len(out.token_ids)
        return delta, tokens, logprobs


def unsent_text(resumed_text: str, text: str, holdback: int) -> str:
    """A whole answer less what a stream cut after its resumed tokens had sent already (all of it if not resumed)."""
    return text[len(ChoiceCursor(holdback, resumed_text).text) :]


class EventStreamResponse(StreamingResponse):
    """SSE response that stops (and so aborts the generation) as soon as the client disconnects,
    even while no token is due, and always closes its body iterator."""

    def __init__(self, content, on_close: Callable[[], Awaitable[None]] | None = None) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    with contextlib.suppress(OSError):  # the client went away mid-send
                        await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            await self.body_iterator.aclose()
            if self.on_close is not None:  # also when the body never started
                await self.on_close()
