"""What a request constrains its output to (torch- and llguidance-free: the server builds these)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

# JSON as json.dumps writes it: no free whitespace, so a small model cannot spend max_tokens on newlines
# (a schema's own "x-guidance" object overrides it: llguidance's JSON options)
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
GuidedKind = Literal["json", "regex", "choice", "grammar", "lark"]  # llguidance.grammar_from formats


class GrammarError(ValueError):
    """A grammar the request gave that cannot be compiled (or resumed): a 400 naming `param`."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"invalid {param}: {message}")
        self.param = param


@dataclass(frozen=True)
class GuidedDecoding:
    """One grammar for every sequence of a request. `spec`: a JSON schema as JSON text, a regex, a JSON list of
    choices, a Lark / GBNF grammar (`grammar`) or a Lark grammar (`lark`: the tool-call grammars);
    `param`: the request field it came from (named in errors)."""

    kind: GuidedKind
    spec: str
    param: str

    @classmethod
    def json_schema(cls, schema: dict | bool, param: str) -> GuidedDecoding:
        return cls("json", json.dumps(schema), param)  # key order kept: properties are generated in it
