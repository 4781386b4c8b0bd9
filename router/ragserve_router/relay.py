"""One SSE stream from an engine to the client, resumed on another engine when its engine dies.

The stream is relayed event by event. It ends with the engine's `data: [DONE]`. A stream that breaks
(connection lost, end of body without [DONE], an error event not scoped to the request) continues on
another healthy engine when its ResumePlan allows it and --migration-limit is not used up: the client
sees one stream (same id and created, no second role chunk, usage summed). Otherwise it ends with an
SSE error event and no [DONE], so SDKs raise instead of taking a truncated answer for a complete one.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator

import httpx

from ragserve.http.errors import REQUEST_SCOPE, ApiError, error_body
from ragserve_router.engine_client import EngineResponse
from ragserve_router.engines import CONNECT, SERVER_ERROR, EngineRecord
from ragserve_router.stream_usage import END, sse
from ragserve_router.upstream import Routed, Upstream

log = logging.getLogger(__name__)
DONE_EVENT = b"data: [DONE]\n\n"
_TOKEN_IDS = re.compile(rb', "token_ids": \[([0-9, ]*)\]')  # a choice's ids, as json.dumps writes them
DONE, CUT, ENGINE_ERROR, REQUEST_ERROR = "done", "cut", "engine_error", "request_error"


class Relay:
    """close() runs exactly once, however the stream ends (the client leaving included)."""

    def __init__(self, upstream: Upstream, r: Routed, engine: EngineRecord, resp: EngineResponse) -> None:
        self.upstream, self.r, self.engine, self.resp = upstream, r, engine, resp
        self.plan = r.plan
        self.tokens: list[int] = []  # output token ids streamed so far (a resume continues after them)
        self.first: dict = {}  # id, object, created, model of the first segment: resumed chunks carry them too
        self.prior = 0  # completion tokens of earlier segments, added to the usage of the last one
        self.tried = {engine.engine_id}
        self.migrations = 0
        self.finished = False  # the (single) choice's finish_reason went out
        self.outcome = CUT
        self.usage: dict | None = None
        self.sent_any = False
        self.closed = False

    async def body(self) -> AsyncIterator[bytes]:
        try:
            while True:
                async for data in self._segment():
                    yield data
                if self.outcome in (DONE, REQUEST_ERROR):
                    return
                if self.finished:  # only the [DONE] was lost
                    yield DONE_EVENT
                    return
                if (tail := await self._resume()) is not None:
                    yield tail
                    return
        finally:
            await self.close()

    async def _segment(self) -> AsyncIterator[bytes]:
        self.outcome, buf = CUT, b""
        try:
            async for chunk in self.resp.aiter_raw():
                *events, buf = (buf + chunk).split(b"\n\n")
                for event in events:
                    if (out := self._event(event)) is not None:
                        if not self.sent_any:
                            self.sent_any = True
                            self.r.first_token(self.upstream.metrics, self.engine.engine_id)
                        yield out
                    if self.outcome in (DONE, ENGINE_ERROR):
                        break
                else:
                    continue
                break
        except httpx.HTTPError as exc:
            log.warning("request %s: engine %s broke the stream: %s", self.r.request_id, self.engine.engine_id, exc)
        if self.outcome in (CUT, ENGINE_ERROR):
            self.upstream.pool.mark_failure(self.engine, CONNECT if self.outcome == CUT else SERVER_ERROR)

    def _event(self, event: bytes) -> bytes | None:
        """What to send the client for one upstream event (None: nothing)."""
        line = event.strip()
        if not line.startswith(b"data:"):
            return event + b"\n\n" if line else None
        data = line[5:].strip()
        if data == b"[DONE]":
            self.outcome = DONE
            return DONE_EVENT
        if (out := self._plain(data)) is not None:
            return out
        try:
            obj = json.loads(data)
        except ValueError:
            return event + b"\n\n"
        if not isinstance(obj, dict):
            return event + b"\n\n"
        if "error" in obj:
            error = obj["error"]
            if isinstance(error, dict) and error.get("scope") == REQUEST_SCOPE:
                self.outcome = REQUEST_ERROR
                return event + b"\n\n"
            self.outcome = ENGINE_ERROR
            return None
        changed = self._chunk(obj)
        if changed is None:
            return None
        return sse(obj) if changed else event + b"\n\n"

    def _plain(self, data: bytes) -> bytes | None:
        """A middle chunk of one choice as a ragserve engine writes it (json.dumps' separators), handled on its bytes:
        its token ids taken, what the client did not ask for (`token_ids`, `"usage": null`) cut out. The bytes
        _chunk's json.dumps would give; None for any other chunk (the first, the last, one with usage, a resumed
        segment's, an error), which _chunk handles."""
        if not self.first or self.migrations or data.count(b'"finish_reason": null') != 1 or b'"error"' in data:
            return None
        usage = data.count(b'"usage"')
        if usage and (usage > 1 or b', "usage": null}' not in data):
            return None
        found = _TOKEN_IDS.findall(data)
        if len(found) > 1 or (not found and self.plan.active):  # _choice decides whether it can still resume
            return None
        if found and self.plan.active:
            self.tokens += [int(t) for t in found[0].split(b", ") if t]
        if found and not self.plan.client_wants_ids:
            data = _TOKEN_IDS.sub(b"", data)
        if usage and self.plan.hides_usage:
            data = data.replace(b', "usage": null}', b"}")
        return b"data: " + data + END

    def _chunk(self, obj: dict) -> bool | None:
        """Collect token ids and usage, hide what the client did not ask for, join resumed segments; None: drop it."""
        changed = False
        if not self.first:
            self.first = {k: obj[k] for k in ("id", "object", "created", "model") if k in obj}
        elif self.migrations:
            obj.update(self.first)
            changed = True
        hidden = self.plan.hides_usage and "usage" in obj  # asked for the quotas, not by the client
        usage = obj.pop("usage") if hidden else obj.get("usage")
        if isinstance(usage, dict):
            if self.prior:
                usage["completion_tokens"] = usage.get("completion_tokens", 0) + self.prior
                usage["total_tokens"] = usage.get("prompt_tokens", 0) + usage["completion_tokens"]
                changed = True
            self.usage = usage
        choices = obj.get("choices")
        if isinstance(choices, list) and choices:
            kept = [c for c in choices if not isinstance(c, dict) or self._choice(c)]
            changed = True if len(kept) != len(choices) or not self.plan.client_wants_ids else changed
            if not kept and obj.get("usage") is None:
                return None
            obj["choices"] = kept
        elif hidden and isinstance(choices, list):
            return None  # the usage-only chunk
        return changed or hidden

    def _choice(self, c: dict) -> bool:
        """Record one choice's token ids and finish; False drops a resumed segment's empty opening chunk."""
        ids = c.get("token_ids") if self.plan.client_wants_ids else c.pop("token_ids", None)
        if self.plan.active:
            if isinstance(ids, list):
                self.tokens += ids
            elif c.get("text") or (c.get("delta") or {}).get("content"):
                self.plan.reason = "no_token_ids"  # an engine that does not stream them: cannot resume
            self.finished = self.finished or bool(c.get("finish_reason"))
        if not self.migrations:
            return True
        delta = c.get("delta")
        if isinstance(delta, dict):
            delta.pop("role", None)
            return any(delta.values()) or bool(c.get("finish_reason") or c.get("logprobs"))
        return True

    async def _resume(self) -> bytes | None:
        """Continue on another engine (None), or the last bytes to send: an error event."""
        cfg = self.upstream.cfg
        reason = self.plan.reason or ("limit" if self.migrations >= cfg.migration_limit else "")
        if reason:
            return self._fail(reason)
        body = self.plan.resumed_body(self.tokens)
        if body is None:  # the engine died right after the last token of the budget: only the end was lost
            self.upstream.metrics.migrations.labels("completed").inc()
            end = {"delta": {}} if self.plan.chat else {"text": ""}
            return sse({**self.first, "choices": [{"index": 0, **end, "finish_reason": "length"}]}) + DONE_EVENT
        engines = self.upstream.fallbacks(self.r, self.tried, only_registered=True)
        if not engines:
            return self._fail("no_engine")
        try:
            engine, resp = await self.upstream.connect(self.r, engines, body)
        except ApiError:
            return self._fail("no_engine")
        self.tried.add(engine.engine_id)
        if resp.status_code != 200:
            await resp.aclose()
            return self._fail("refused")
        await self.resp.aclose()
        log.info(
            "request %s: stream moved from engine %s to %s after %d tokens",
            self.r.request_id, self.engine.engine_id, engine.engine_id, len(self.tokens),
        )  # fmt: skip
        self.engine, self.resp = engine, resp
        self.prior = len(self.tokens)
        self.migrations += 1
        self.upstream.metrics.migrations.labels("resumed").inc()
        return None

    def _fail(self, reason: str) -> bytes:
        self.upstream.metrics.migrations.labels(reason).inc()
        log.warning("request %s: stream from engine %s lost (%s)", self.r.request_id, self.engine.engine_id, reason)
        message = f"the engine serving this stream failed and it could not be resumed ({reason}): answer incomplete"
        return sse(error_body(502, message, "stream_interrupted"))

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:  # a client that left may cancel this (level-triggered, anyio) at any await in the close
            await self.resp.aclose()
        finally:  # its slot and queue place go back all the same (else each such exit leaks one for good)
            self.upstream.finish(self.r, self.engine, self.usage)
