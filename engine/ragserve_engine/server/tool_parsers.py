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
from dataclasses import dataclass, field

from ragserve_engine.engine_client import JSON_FORMAT


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_dict(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


class ToolParser:
    name = ""
    start = ""  # where calls begin in the text
    args_key = "arguments"

    def call_start(self, text: str) -> int:
        """Where tool calls begin in `text` (-1: none yet)."""
        return text.find(self.start)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content before the calls or None, the calls); text whose calls do not parse is all content."""
        at = self.call_start(text)
        if at < 0:
            return text, []
        calls = self.parse_calls(text[at:])
        if not calls:
            return text, []
        return text[:at].strip() or None, calls

    def parse_calls(self, text: str) -> list[ToolCall]:
        raise NotImplementedError

    def to_call(self, obj) -> ToolCall | None:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get(self.args_key, obj.get("arguments", {}))
        return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False)) if isinstance(args, dict) else None

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
        return f"start: {json.dumps(self.start)} %json {json.dumps(self.call_schema(tools))}"

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
    name, start = "hermes", "<tool_call>\n"
    _call = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def call_start(self, text: str) -> int:
        return text.find("<tool_call>")

    def parse_calls(self, text: str) -> list[ToolCall]:
        return _all_or_none([self.to_call(_loads(m)) for m in self._call.findall(text)])

    def forced_grammar(self, tools: list[dict]) -> str:
        return f'start: "<tool_call>\\n" %json {json.dumps(self.call_schema(tools))} "\\n</tool_call>"'

    def format_calls(self, calls: list[dict]) -> str:
        return "\n".join(f"<tool_call>\n{json.dumps(self._obj(c))}\n</tool_call>" for c in calls)


class Llama3JsonParser(ToolParser):
    name, args_key = "llama3_json", "parameters"
    _tag = "<|python_tag|>"

    def call_start(self, text: str) -> int:
        stripped = text.lstrip()
        return len(text) - len(stripped) if stripped.startswith(("{", self._tag)) else -1

    def parse_calls(self, text: str) -> list[ToolCall]:
        text, decoder, objs = text.strip().removeprefix(self._tag).strip(), json.JSONDecoder(), []
        while text:
            try:
                obj, end = decoder.raw_decode(text)
            except ValueError:
                return []
            objs.append(obj)
            text = text[end:].strip().removeprefix(";").strip()
        return _all_or_none([self.to_call(o) for o in objs])

    def forced_grammar(self, tools: list[dict]) -> str:
        return f"start: %json {json.dumps(self.call_schema(tools))}"

    def format_calls(self, calls: list[dict]) -> str:
        return "; ".join(json.dumps(self._obj(c)) for c in calls)


class MistralParser(ToolParser):
    name, start = "mistral", "[TOOL_CALLS]"

    def parse_calls(self, text: str) -> list[ToolCall]:
        try:
            objs = json.JSONDecoder().raw_decode(text[len(self.start) :].strip())[0]
        except ValueError:
            return []
        return _all_or_none([self.to_call(o) for o in objs]) if isinstance(objs, list) else []

    def forced_grammar(self, tools: list[dict]) -> str:
        calls = {"type": "array", "items": self.call_schema(tools), "minItems": 1, "maxItems": 1}
        return f'start: "[TOOL_CALLS]" %json {json.dumps(calls)}'

    def format_calls(self, calls: list[dict]) -> str:
        return self.start + json.dumps([self._obj(c) for c in calls])


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _all_or_none(calls: list[ToolCall | None]) -> list[ToolCall]:
    return [c for c in calls if c is not None] if calls and all(calls) else []
