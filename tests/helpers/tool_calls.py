"""Checks of streamed chat tool calls (openai SDK chunks). No tests here."""

from __future__ import annotations

import json


def streamed_calls(deltas) -> list[tuple[str, str]]:
    """(name, arguments) per streamed call, checking the pieces stream as OpenAI's do: a first entry with
    index, id, type, name and empty arguments, then arguments fragments only (more than one), in order."""
    entries = [t for d in deltas for t in d.tool_calls or []]
    out = []
    for index in sorted({t.index for t in entries}):
        first, *rest = [t for t in entries if t.index == index]
        assert first.id.startswith("call_") and first.type == "function" and first.function.arguments == ""
        assert all(t.id is None and t.type is None and t.function.name is None for t in rest)
        assert len(rest) > 1, "the arguments came in one piece"
        arguments = "".join(t.function.arguments for t in rest)
        json.loads(arguments)
        out.append((first.function.name, arguments))
    return out
