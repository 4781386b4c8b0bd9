"""x-kubernetes-validations rules run as the API server runs them, by a real CEL evaluator (cel-python): each
rule on the value at its schema node (every item of a list, every value of a map), `self` bound to it and
`oldSelf` to the previous value (transition rules run on updates only). tests/operator/test_cel.py checks the
RAGServe CRDs' rules with it, tests/helpers/gateway_api.py the upstream Gateway API CRDs'."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import celpy

ENV = celpy.Environment()
Rule = tuple[str, dict]  # (path: "spec.engines[]", the rule)


def rules_of(schema: dict, path: str = "") -> Iterator[Rule]:
    for rule in schema.get("x-kubernetes-validations", []):
        yield path, rule
    for key, sub in schema.get("properties", {}).items():
        yield from rules_of(sub, f"{path}.{key}".lstrip("."))
    if "items" in schema:
        yield from rules_of(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from rules_of(schema["additionalProperties"], f"{path}{{}}")


def values_at(obj: Any, path: str) -> list[Any]:
    """The values a rule at `path` runs on ("spec.engines[]": every pool, "spec.labels{}": every value)."""
    values = [obj]
    for part in [p for p in path.replace("[]", ".[]").replace("{}", ".{}").split(".") if p]:
        if part == "[]":
            values = [item for v in values for item in (v or [])]
        elif part == "{}":
            values = [item for v in values for item in (v or {}).values()]
        else:
            values = [v[part] for v in values if isinstance(v, dict) and part in v]
    return values


@functools.cache
def program(rule: str) -> celpy.Runner:
    return ENV.program(ENV.compile(rule))


def holds(rule: str, value: Any, old: Any = None) -> bool:
    """One rule on one value; a transition rule (oldSelf) holds on create, as the API server skips it."""
    if "oldSelf" in rule and old is None:
        return True
    activation = {"self": celpy.json_to_cel(value)}
    if old is not None:
        activation["oldSelf"] = celpy.json_to_cel(old)
    result = program(rule).evaluate(activation)
    assert isinstance(result, celpy.celtypes.BoolType), f"{rule!r} gave {result!r}, not a bool"
    return bool(result)
