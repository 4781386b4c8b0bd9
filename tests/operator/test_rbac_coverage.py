"""Over-granting fails too: every verb and resource the chart's operator RBAC grants (Role and
ClusterRole, charts/ragserve/templates/operator/) is used by some call the operator made in this
session's tests (each call already checked against the rules when its API closed, conftest.py). Runs
last, and only where the whole tests/operator directory is collected (conftest.py)."""

from __future__ import annotations

from tests.operator import rbac


def test_every_rule_the_chart_grants_the_operator_is_used():
    assert len(rbac.OPERATOR_CALLS) > 20, "no operator test ran before this one"
    assert rbac.unused(rbac.operator_rules(), rbac.OPERATOR_CALLS) == []
