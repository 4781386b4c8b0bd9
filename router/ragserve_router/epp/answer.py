"""An engine's answer as the endpoint picker sees it pass through the gateway: its status, whether it streams,
its first streamed byte, its usage (the last SSE event carrying one, or the JSON body's) and how it ended."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from starlette.datastructures import Headers

from ragserve.http.outcomes import error_reason

BROKEN = 502  # a stream that ended without [DONE], counted as the HTTP gateway counts it


@dataclass
class Answer:
    status: int
    stream: bool  # an event stream (text/event-stream)
    limit: int  # bytes of body (or of one pending event) kept to read usage and errors from
    pending: bytearray = field(default_factory=bytearray)  # the JSON body, or the SSE event not complete yet
    started: bool = False  # a body byte went by
    done: bool = False  # data: [DONE] went by
    last_usage: dict | None = None

    @classmethod
    def of(cls, headers: Headers, limit: int) -> Answer:
        status = headers.get(":status", "")
        stream = headers.get("content-type", "").startswith("text/event-stream")
        return cls(int(status) if status.isdigit() else 0, stream, limit)

    def feed(self, chunk: bytes) -> bool:
        """Read one body chunk; True when it holds the answer's first streamed byte."""
        first = self.stream and bool(chunk) and not self.started
        self.started = self.started or bool(chunk)
        self.pending += chunk
        if self.stream:
            *events, rest = bytes(self.pending).split(b"\n\n")
            for event in events:
                self._event(event)
            self.pending = bytearray(rest)
        if len(self.pending) > self.limit:  # too big to read: usage unknown, the bytes still pass
            self.pending.clear()
        return first

    def _event(self, event: bytes) -> None:
        data = event.strip()
        if not data.startswith(b"data:"):
            return
        data = data[5:].strip()
        if data == b"[DONE]":
            self.done = True
        elif b'"usage"' in data:
            self.last_usage = _usage(data) or self.last_usage

    def usage(self) -> dict | None:
        if self.stream:
            return self.last_usage
        return _usage(bytes(self.pending)) if self.status == 200 else None

    def outcome(self) -> tuple[int, str]:
        """(status, reason) the answer is counted under."""
        if not self.status or self.stream and self.status == 200 and not self.done:
            return BROKEN, "stream_broken"
        return self.status, error_reason(self.status, bytes(self.pending))


def _usage(data: bytes) -> dict | None:
    try:
        obj = json.loads(data)
    except ValueError:
        return None
    usage = obj.get("usage") if isinstance(obj, dict) else None
    return usage if isinstance(usage, dict) else None
