"""Tool-call formats (--tool-call-parser): finding calls in generated text, and the grammar that forces one.

hermes: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` (Hermes, Qwen 2.5/3)
llama3_json: `{"name": ..., "parameters": {...}}` (optionally after <|python_tag|>; several joined by `;`)
mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

from ragserve_engine.engine_client import JSON_FORMAT
from ragserve_engine.server.partial_json import Member, members, skip_ws, value_end


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class PartialCall:
    """One call object in text that may still grow: its name once whole, where its arguments are."""

    start: int  # of the object
    name: str | None
    args: Member | None
    end: int | None  # of the object; None while incomplete


class ToolParser:
    """`specials`: the tokenizer's special tokens (text -> id); a marker that is one is forced by id."""

    name = ""
    start = ""  # where calls begin in the text
    end = ""  # what closes a call, if anything
    args_key = "arguments"

    def __init__(self, specials: dict[str, int] | None = None) -> None:
        self.specials = specials or {}

    @property
    def special_markers(self) -> bool:
        """Whether a marker is a special token (the text must then be decoded with special tokens kept)."""
        return any(m.strip() in self.specials for m in (self.start, self.end) if m.strip())

    def call_start(self, text: str) -> int:
        """Where tool calls begin in `text` (-1: none yet)."""
        return text.find(self.start)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content before the calls or None, the calls); text whose calls do not parse is all content.

        A call's arguments are the model's own JSON text (what a stream sends piecewise)."""
        at = self.call_start(text)
        if at < 0:
            return text, []
        calls = [self.to_call(text[at:], p) for p in self.partial_calls(text[at:])]
        if not calls or not all(calls) or not self.complete(text[at:], self.partial_calls(text[at:])):
            return text, []
        return text[:at].strip() or None, calls

    def partial_calls(self, text: str) -> list[PartialCall]:
        """The call objects in `text` (which begins where calls do), the last one perhaps incomplete."""
        out = []
        for i in self.object_starts(text):
            found, end = members(text, i)
            by_key = {m.key: m for m in found}
            name = by_key.get("name")
            name = _loads(text[name.start : name.end]) if name is not None and name.end is not None else None
            args = by_key.get(self.args_key) or by_key.get("arguments")
            out.append(PartialCall(i, name if isinstance(name, str) else None, args, end))
            if end is None:
                break
        return out

    def object_starts(self, text: str) -> Iterator[int]:
        raise NotImplementedError

    def complete(self, text: str, calls: list[PartialCall]) -> bool:
        """Whether nothing but whitespace and call syntax follows the calls (default: any text may)."""
        return True

    def to_call(self, text: str, call: PartialCall) -> ToolCall | None:
        if call.end is None or call.name is None or call.args is None or call.args.end is None:
            return None
        obj, args = _loads(text[call.start : call.end]), text[call.args.start : call.args.end]
        return ToolCall(call.name, args) if isinstance(obj, dict) and isinstance(_loads(args), dict) else None

    def literal(self, marker: str) -> str:
        """A marker in a Lark grammar: its special token by id where it is one, else its text."""
        core = marker.strip()
        if core not in self.specials:
            return json.dumps(marker)
        before, after = marker[: marker.index(core)], marker[marker.index(core) + len(core) :]
        return " ".join(x for x in (json.dumps(before) if before else "", f"<[{self.specials[core]}]>",
                                    json.dumps(after) if after else "") if x)  # fmt: skip

    def call_schema(self, tools: list[dict]) -> dict:
        """A JSON schema of one call to one of `tools` (each an OpenAI function definition)."""
        one = [
            {
                "type": "object",
                "properties": {"name": {"const": t["name"]}, self.args_key: t.get("parameters") or {"type": "object"}},
                "required": ["name", self.args_key],
                "additionalProperties": False,
            }
            for t in tools
        ]
        return {**(one[0] if len(one) == 1 else {"anyOf": one}), "x-guidance": JSON_FORMAT}

    def forced_grammar(self, tools: list[dict]) -> str:
        """A Lark grammar (llguidance's, with %json) of exactly one call to one of `tools`."""
        return f"start: {self.literal(self.start)} %json {json.dumps(self.call_schema(tools))}"

    def format_calls(self, calls: list[dict]) -> str:
        """Calls an assistant message made (OpenAI tool_calls), as this format's text (the fallback rendering)."""
        return "".join(self.start + json.dumps(self._obj(c)) for c in calls)

    def _obj(self, call: dict) -> dict:
        fn = call.get("function") or {}
        args = fn.get("arguments") or "{}"
        with contextlib.suppress(ValueError):
            args = json.loads(args) if isinstance(args, str) else args
        return {"name": fn.get("name"), self.args_key: args}


class HermesParser(ToolParser):
    name, start, end = "hermes", "<tool_call>\n", "</tool_call>"

    def call_start(self, text: str) -> int:
        return text.find("<tool_call>")

    def object_starts(self, text: str) -> Iterator[int]:
        for m in re.finditer("<tool_call>", text):
            at = skip_ws(text, m.end())
            if at < len(text) and text[at] == "{":
                yield at

    def forced_grammar(self, tools: list[dict]) -> str:
        schema = json.dumps(self.call_schema(tools))
        return f"start: {self.literal(self.start)} %json {schema} {self.literal(chr(10) + self.end)}"

    def format_calls(self, calls: list[dict]) -> str:
        return "\n".join(f"<tool_call>\n{json.dumps(self._obj(c))}\n</tool_call>" for c in calls)


class Llama3JsonParser(ToolParser):
    name, args_key = "llama3_json", "parameters"
    _tag = "<|python_tag|>"

    def call_start(self, text: str) -> int:
        stripped = text.lstrip()
        return len(text) - len(stripped) if stripped.startswith(("{", self._tag)) else -1

    def object_starts(self, text: str) -> Iterator[int]:
        at = skip_ws(text, 0)
        at = skip_ws(text, at + len(self._tag)) if text.startswith(self._tag, at) else at
        yield from _separated(text, at, ";")

    def complete(self, text: str, calls: list[PartialCall]) -> bool:
        return not text[calls[-1].end :].strip().lstrip(";").strip()  # a call is the whole answer

    def forced_grammar(self, tools: list[dict]) -> str:
        return f"start: %json {json.dumps(self.call_schema(tools))}"

    def format_calls(self, calls: list[dict]) -> str:
        return "; ".join(json.dumps(self._obj(c)) for c in calls)


class MistralParser(ToolParser):
    name, start = "mistral", "[TOOL_CALLS]"

    def object_starts(self, text: str) -> Iterator[int]:
        at = skip_ws(text, len(self.start))
        if at < len(text) and text[at] == "[":
            yield from _separated(text, skip_ws(text, at + 1), ",")

    def complete(self, text: str, calls: list[PartialCall]) -> bool:
        return text[skip_ws(text, calls[-1].end) :].startswith("]")

    def forced_grammar(self, tools: list[dict]) -> str:
        calls = {
            "type": "array",
            "items": self.call_schema(tools),
            "minItems": 1,
            "maxItems": 1,
            "x-guidance": JSON_FORMAT,
        }
        return f"start: {self.literal(self.start)} %json {json.dumps(calls)}"

    def format_calls(self, calls: list[dict]) -> str:
        return self.start + json.dumps([self._obj(c) for c in calls])


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _separated(text: str, at: int, sep: str) -> Iterator[int]:
    """Object starts from `at` on, separated by `sep` (and whitespace)."""
    while at < len(text) and text[at] == "{":
        yield at
        end = value_end(text, at)
        if end is None:
            return
        at = skip_ws(text, end)
        at = skip_ws(text, at + 1) if text.startswith(sep, at) else at


def specials(tokenizer) -> dict[str, int]:
    """A PromptTokenizer's special added tokens, text -> id."""
    added = tokenizer.tokenizer.get_added_tokens_decoder()
    return {t.content: i for i, t in added.items() if t.special}
