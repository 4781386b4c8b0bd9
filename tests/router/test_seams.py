"""The router's internal seams: modules use each other's public names only, and a routed request is complete
(and frozen) from the moment it exists."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from ragserve_router.upstream import Routed

ROUTER = Path(__file__).resolve().parents[2] / "router" / "ragserve_router"


def _reaches_in(node: ast.AST) -> bool:
    """`obj._name` where obj is not `self` or `cls` (dunders aside): another object's private member."""
    if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
        return False
    return not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))


def private_reaches(source: str) -> list[str]:
    return [f"{node.lineno}: {ast.unparse(node)}" for node in ast.walk(ast.parse(source)) if _reaches_in(node)]


def test_private_reaches_are_found():
    assert private_reaches("self._a(); cls._b; x.__dict__; self.proxy._finish(r)") == ["1: self.proxy._finish"]


@pytest.mark.parametrize("path", sorted(ROUTER.glob("*.py")), ids=lambda p: p.name)
def test_no_router_module_reaches_into_another_objects_privates(path):
    assert private_reaches(path.read_text()) == []


def test_a_routed_request_is_complete_and_frozen_at_construction():
    assert Routed.__dataclass_params__.frozen
    optional = [f.name for f in dataclasses.fields(Routed) if f.default is not dataclasses.MISSING]
    assert optional == [], "a Routed is built once, with everything the proxy and relay read"
