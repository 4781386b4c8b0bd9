"""Server-sent events: text deltas that never take back what was sent, and a response that aborts on disconnect."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Awaitable, Callable

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ragserve_engine.outputs import CompletionOutput


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


class ChoiceCursor:
    """What of one choice's text, tokens and logprobs has been streamed so far.

    The engine re-decodes the whole output each step: a trailing incomplete UTF-8 character
    or the start of a stop string may still change, so they are held back until final.
    """

    def __init__(self, holdback: int) -> None:
        self.holdback = holdback
        self.text = ""
        self.num_tokens = 0

    def advance(self, out: CompletionOutput) -> tuple[str, list[int], list[dict[int, float]]]:
        text = out.text
        if not out.finished:
            text = text.rstrip("\ufffd")
            text = text[: max(len(self.text), len(text) - self.holdback)]
        delta = text[len(self.text) :] if text.startswith(self.text) else ""
        self.text += delta
        tokens = out.token_ids[self.num_tokens :]
        logprobs = (out.logprobs or [])[self.num_tokens :]
        self.num_tokens = len(out.token_ids)
        return delta, tokens, logprobs


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
