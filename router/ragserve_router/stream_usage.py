"""Usage of streamed answers, for tenant quotas and fair queueing (gate.Claim.settle), whether the client asked.

A stream is sent to the engine with `stream_options.include_usage` set. When the client did not ask for it, what
the engine adds for it is taken out of what the client sees: the `"usage": null` of every chunk and the last,
usage-only chunk (`"choices": []`). A chunk is written back as the engine wrote it (`json.dumps`, keys in order,
`ensure_ascii=False`), so the client's stream is byte for byte the one it asked for. The HTTP gateway does it in
relay.py, the endpoint picker with HiddenUsage (it sees the answer's body pass through the gateway).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

END = b"\n\n"


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + END


def asks_usage(body: dict) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def hides_usage(body: dict) -> bool:
    """A stream whose client did not ask for usage: the engine is asked, the client sees none."""
    return body.get("stream") is True and not asks_usage(body)


def with_usage(body: dict) -> dict:
    """The body asking the engine for the stream's usage (the client's other stream options kept)."""
    options = body.get("stream_options")
    return {**body, "stream_options": {**(options if isinstance(options, dict) else {}), "include_usage": True}}


def strip_usage(event: bytes) -> bytes:
    """One SSE event (without its blank line) as the client sees it: the usage out, a usage-only chunk gone."""
    line = event.strip()
    if line.startswith(b"data:") and b'"usage"' in line:
        try:
            obj = json.loads(line[5:])
        except ValueError:
            return event + END
        if isinstance(obj, dict) and "usage" in obj:
            del obj["usage"]
            return b"" if obj.get("choices") == [] else sse(obj)
    return event + END


@dataclass
class HiddenUsage:
    """The endpoint picker's view of a stream it hides the usage of: whole events out, usage stripped."""

    limit: int  # bytes of one pending event; a longer one passes as it is
    pending: bytearray = field(default_factory=bytearray)

    def feed(self, chunk: bytes, end: bool) -> bytes:
        self.pending += chunk
        *events, rest = bytes(self.pending).split(END)
        out = b"".join(strip_usage(e) for e in events)
        if end or len(rest) > self.limit:
            out, rest = out + rest, b""
        self.pending = bytearray(rest)
        return out
