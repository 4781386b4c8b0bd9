"""Structured-output request fields (OpenAI's response_format, vLLM's guided_*) as one GuidedDecoding.

Shapes are checked here (a 400 naming the field); the grammar itself compiles in the engine, whose
GrammarError names the field too.
"""

from __future__ import annotations

import json
from typing import Any

from ragserve.http.errors import ApiError
from ragserve_engine.engine_client import GuidedDecoding

GUIDED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


def invalid(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", "invalid_value", param)


def from_response_format(rf: dict[str, Any]) -> GuidedDecoding | None:
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedDecoding.json_schema({"type": "object"}, "response_format")
    if kind != "json_schema":
        raise invalid("response_format.type", "must be one of text, json_object, json_schema")
    spec = rf.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
        raise invalid("response_format.json_schema.name", "a json_schema needs a non-empty name")
    schema = spec.get("schema", {})  # OpenAI: absent means any JSON object... of the schema {}
    if not isinstance(schema, dict | bool):
        raise invalid("response_format.json_schema.schema", "must be a JSON schema object")
    return GuidedDecoding.json_schema(schema, "response_format.json_schema.schema")


def from_guided_json(value: Any) -> GuidedDecoding:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise invalid("guided_json", "must be a JSON schema (an object, or its JSON text)") from None
    if not isinstance(value, dict | bool):
        raise invalid("guided_json", "must be a JSON schema (an object, or its JSON text)")
    return GuidedDecoding.json_schema(value, "guided_json")


def guided_decoding(body: Any) -> GuidedDecoding | None:
    """The request's one grammar, or None; two grammar fields at once are a 400 naming the second."""
    found: list[GuidedDecoding] = []
    if body.response_format is not None and (g := from_response_format(body.response_format)) is not None:
        found.append(g)
    if body.guided_json is not None:
        found.append(from_guided_json(body.guided_json))
    if body.guided_regex is not None:
        found.append(GuidedDecoding("regex", _text(body.guided_regex, "guided_regex"), "guided_regex"))
    if body.guided_choice is not None:
        choices = body.guided_choice
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise invalid("guided_choice", "must be a non-empty list of non-empty strings")
        found.append(GuidedDecoding("choice", json.dumps(choices), "guided_choice"))
    if body.guided_grammar is not None:
        found.append(GuidedDecoding("grammar", _text(body.guided_grammar, "guided_grammar"), "guided_grammar"))
    if len(found) > 1:
        raise invalid(found[1].param.split(".")[0], f"give at most one of {', '.join(GUIDED_FIELDS)}")
    return found[0] if found else None


def _text(value: str, param: str) -> str:
    if not value:
        raise invalid(param, "must not be empty")
    return value
