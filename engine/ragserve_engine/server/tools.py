"""Chat `tools` and `tool_choice`: checks, prompt rendering, forced calls and the streamed tool_calls deltas.

The tools reach the prompt through the model's chat template when it takes `tools`; a template that does
not (SmolLM2's) gets them in the system message with the parser's call format (FALLBACK). `required` and a
named function force exactly one call with a grammar of the parser's format whose arguments follow the
function's `parameters` schema.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from ragserve_engine.engine_client import GuidedDecoding
from ragserve_engine.server.structured import invalid
from ragserve_engine.server.tool_parsers import ToolCall, ToolParser

FALLBACK = (
    "You can call these functions (JSON schemas of their arguments):\n{tools}\n"
    "To call one, answer with nothing else than:\n{example}"
)
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass
class ToolRequest:
    """The request's functions and choice ("none", "auto", "required" or a function name)."""

    functions: list[dict] = field(default_factory=list)
    choice: str = "none"
    parallel: bool = True  # parallel_tool_calls: false keeps the first call only

    def calls(self, calls: list[ToolCall]) -> list[ToolCall]:
        return calls if self.parallel else calls[:1]

    @property
    def active(self) -> bool:
        return self.choice != "none"

    @property
    def forced(self) -> list[dict] | None:
        """The functions one of which must be called, or None."""
        if self.choice in ("none", "auto"):
            return None
        return self.functions if self.choice == "required" else [f for f in self.functions if f["name"] == self.choice]


def tool_request(tools: list | None, choice: Any, parallel: bool = True) -> ToolRequest:
    functions = [_function(i, t) for i, t in enumerate(tools or [])]
    if choice is None:
        return ToolRequest(functions, "auto" if functions else "none", parallel)
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise invalid("tool_choice", "must be none, auto, required or {'type': 'function', 'function': {'name'}}")
        choice = fn["name"]
        if choice not in {f["name"] for f in functions}:
            raise invalid("tool_choice", f"names function {choice[:64]!r}, which is not in tools")
    elif choice not in ("none", "auto", "required"):
        raise invalid("tool_choice", "must be none, auto, required or {'type': 'function', 'function': {'name'}}")
    elif choice != "none" and not functions:
        raise invalid("tool_choice", f"{choice!r} needs tools")
    return ToolRequest(functions, choice, parallel)


def _function(i: int, tool: Any) -> dict:
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
        raise invalid(f"tools.{i}", "must be {'type': 'function', 'function': {...}}")
    if not isinstance(fn.get("name"), str) or not _NAME.match(fn["name"]):
        raise invalid(f"tools.{i}.function.name", "must be 1-64 letters, digits, '_' or '-'")
    if not isinstance(fn.get("parameters", {}), dict):
        raise invalid(f"tools.{i}.function.parameters", "must be a JSON schema object")
    if not isinstance(fn.get("description", ""), str):
        raise invalid(f"tools.{i}.function.description", "must be a string")
    return fn


def forced_grammar(tools: ToolRequest, parser: ToolParser) -> GuidedDecoding | None:
    forced = tools.forced
    return None if forced is None else GuidedDecoding("lark", parser.forced_grammar(forced), "tool_choice")


def render_messages(messages: list[dict], tools: ToolRequest, parser: ToolParser, template: str) -> tuple[list, dict]:
    """(messages, template kwargs): `tools` for a template that takes them, else the FALLBACK system prompt."""
    if not tools.active:
        return messages, {}
    if "tools" in template:
        return messages, {"tools": [{"type": "function", "function": f} for f in tools.functions]}
    example = parser.format_calls([{"function": {"name": "NAME", "arguments": {"ARGUMENT": "VALUE"}}}])
    specs = "\n".join(json.dumps(f, ensure_ascii=False) for f in tools.functions)
    prompt = FALLBACK.format(tools=specs, example=example)
    out = [_as_text(m, parser) for m in messages]
    if out and out[0].get("role") == "system":
        return [{**out[0], "content": f"{out[0].get('content') or ''}\n\n{prompt}"}, *out[1:]], {}
    return [{"role": "system", "content": prompt}, *out], {}


def _as_text(message: dict, parser: ToolParser) -> dict:
    """An assistant message's tool_calls as the parser's text (a template without tools renders only content)."""
    if message.get("role") != "assistant" or not message.get("tool_calls"):
        return message
    text = parser.format_calls(message["tool_calls"])
    return {**message, "content": f"{message.get('content') or ''}{text}"}


class ToolStream:
    """One streamed choice as vLLM streams it: content until a call may begin, then each call piecewise (a
    first delta with its index, id, type and name, then its arguments' JSON text as the model writes it)."""

    def __init__(self, parser: ToolParser, tools: ToolRequest) -> None:
        self.parser, self.tools = parser, tools
        self.text = ""
        self.sent = 0  # characters of text sent as content
        self.calls: list[tuple[str, int]] = []  # (id, characters of arguments sent) per call begun

    def feed(self, delta: str, finished: bool) -> tuple[str, list[dict]]:
        """(content to send now, tool_calls delta entries to send now)."""
        self.text += delta
        at = self.parser.call_start(self.text)
        if finished:
            _, calls = self.parser.extract(self.text)
            if not calls and not self.calls:
                return self._send(len(self.text)), []
            return self._send(at), self._deltas(self.text[at:])  # a begun call that fails to parse ends here
        if at < 0:
            return self._send(len(self.text) - _partial_marker(self.text, self.parser)), []
        return self._send(at), self._deltas(self.text[at:])

    def _deltas(self, text: str) -> list[dict]:
        out = []
        for index, call in enumerate(self.tools.calls(self.parser.partial_calls(text))):
            if call.name is None or call.args is None:
                break
            if index == len(self.calls):
                self.calls.append((ToolCall(call.name, "").id, 0))
                out.append({"index": index, "id": self.calls[index][0], "type": "function",
                            "function": {"name": call.name, "arguments": ""}})  # fmt: skip
            args = text[call.args.start : call.args.end or len(text)]
            call_id, sent = self.calls[index]
            if len(args) > sent:
                out.append({"index": index, "function": {"arguments": args[sent:]}})
                self.calls[index] = (call_id, len(args))
        return out

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def _send(self, upto: int) -> str:
        upto = max(upto, self.sent)
        out, self.sent = self.text[self.sent : upto], upto
        return out


def _partial_marker(text: str, parser: ToolParser) -> int:
    """How many trailing characters could start a call (held back); an empty text might be a llama3 call."""
    if not parser.start:
        return len(text) if not text.strip() else 0
    marker = parser.start.strip()
    return next((k for k in range(min(len(marker), len(text)), 0, -1) if marker.startswith(text[-k:])), 0)
