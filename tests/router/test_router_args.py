"""The router's launch spec (ragserve.router_args) names the policies the router registers, in its order."""

from __future__ import annotations

from ragserve.router_args import DEFAULT_POLICY, POLICIES
from ragserve_router.policies import POLICY_CLASSES


def test_policies_are_the_registered_classes_in_order() -> None:
    assert [cls.name for cls in POLICY_CLASSES.values()] == list(POLICIES)
    assert list(POLICY_CLASSES) == list(POLICIES)
    assert DEFAULT_POLICY in POLICIES
