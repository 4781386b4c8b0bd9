"""Spans of JSON values in text that may still be growing: where a streamed tool call's name and arguments are.

Positions only (nothing is parsed but keys): a value whose end has not arrived yet has end None.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_WS = " \t\r\n"


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def value_end(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON value that starts at text[i], or None while it is incomplete."""
    depth, in_str, escaped = 0, False, False
    for j in range(i, len(text)):
        c = text[j]
        if in_str:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_str = False
                if depth == 0:
                    return j + 1
        elif c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth <= 0:
                return j + 1 if depth == 0 else j
        elif depth == 0 and c in ",:" + _WS:  # the end of a number, true, false or null
            return j
    return None


@dataclass
class Member:
    key: str
    start: int
    end: int | None  # None: the value is still incomplete


def members(text: str, i: int) -> tuple[list[Member], int | None]:
    """(the members of the object that starts at text[i] so far, the object's end or None)."""
    out: list[Member] = []
    j = skip_ws(text, i + 1)
    while j < len(text):
        if text[j] == "}":
            return out, j + 1
        if text[j] == ",":
            j = skip_ws(text, j + 1)
            continue
        key_end = value_end(text, j) if text[j] == '"' else None
        colon = skip_ws(text, key_end) if key_end is not None else len(text)
        start = skip_ws(text, colon + 1)
        if colon >= len(text) or text[colon] != ":" or start >= len(text):
            return out, None
        try:
            key = json.loads(text[j:key_end])
        except ValueError:
            return out, None
        out.append(Member(key, start, value_end(text, start)))
        if out[-1].end is None:
            return out, None
        j = skip_ws(text, out[-1].end)
    return out, None
