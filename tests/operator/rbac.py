"""The chart's RBAC as the API server reads it: the rules bound to a ServiceAccount in the rendered chart,
and whether they allow a call (verb, API group, resource[/subresource]) that KubeSim recorded."""

from __future__ import annotations

import functools
from pathlib import Path

import helm_python as helm
import yaml

CHART = Path(__file__).resolve().parents[2] / "charts" / "ragserve"
RELEASE, NAMESPACE = "rs", "ai"
Call = tuple[str, str, str]  # (verb, group, resource or resource/subresource)
OPERATOR_CALLS: set[Call] = set()  # every call the operator made in this session (test_rbac_coverage.py)


@functools.cache
def rendered(values_yaml: str) -> tuple[dict, ...]:
    with helm.Chart.load(CHART) as chart:
        out = chart.render(yaml.safe_load(values_yaml), name=RELEASE, namespace=NAMESPACE)
    return tuple(
        d for path, text in sorted(out.items()) if not path.endswith(".txt") for d in yaml.safe_load_all(text) if d
    )


def rules_of(manifests: tuple[dict, ...], component: str) -> list[dict]:
    """The rules bound to the ServiceAccount of `component`'s Deployment (Roles and ClusterRoles)."""
    deployment = next(
        m
        for m in manifests
        if m["kind"] == "Deployment" and m["metadata"]["labels"].get("app.kubernetes.io/component") == component
    )
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    roles = {(m["kind"], m["metadata"]["name"]): m for m in manifests if m["kind"] in ("Role", "ClusterRole")}
    bound = [
        m["roleRef"]
        for m in manifests
        if m["kind"] in ("RoleBinding", "ClusterRoleBinding")
        and any(s["kind"] == "ServiceAccount" and s["name"] == account for s in m.get("subjects") or [])
    ]
    return [rule for ref in bound for rule in roles[(ref["kind"], ref["name"])]["rules"]]


def allows(rules: list[dict], call: Call) -> bool:
    verb, group, resource = call
    return any(
        _has(rule["apiGroups"], group) and _has(rule["resources"], resource) and _has(rule["verbs"], verb)
        for rule in rules
    )


def granted(rules: list[dict]) -> set[Call]:
    """Every (verb, group, resource) the rules name."""
    return {(v, g, r) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


def _has(names: list[str], name: str) -> bool:
    return "*" in names or name in names


def operator_rules() -> list[dict]:
    return rules_of(rendered(yaml.safe_dump({"operator": {"enabled": True}})), "operator")


def router_rules() -> list[dict]:
    return rules_of(rendered(yaml.safe_dump({"router": {"kubernetesDiscovery": {"enabled": True}}})), "router")


def check_operator_calls(calls: set[Call]) -> None:
    """Every call a client of the in-memory API made is one the chart lets the operator make."""
    rules = operator_rules()
    refused = sorted(c for c in calls if not allows(rules, c))
    assert not refused, f"calls the chart's operator RBAC does not allow: {refused}"


def check_router_calls(calls: set[Call]) -> None:
    """Every call a client of the in-memory API made is one the chart lets the router make."""
    rules = router_rules()
    refused = sorted(c for c in calls if not allows(rules, c))
    assert not refused, f"calls the chart's router RBAC does not allow: {refused}"


def unused(rules: list[dict], calls: set[Call]) -> list[str]:
    """What a rule grants that no call used: a verb no call of its resources made, or a resource no call of
    its verbs touched (each would be an over-grant)."""
    out = []
    for rule in rules:
        pairs = [(g, r) for g in rule["apiGroups"] for r in rule["resources"]]
        out += [f"{v} on {rule['resources']}" for v in rule["verbs"] if not any((v, g, r) in calls for g, r in pairs)]
        out += [
            f"{r} ({'/'.join(rule['verbs'])})"
            for g in rule["apiGroups"]
            for r in rule["resources"]
            if not any((v, g, r) in calls for v in rule["verbs"])
        ]
    return out
