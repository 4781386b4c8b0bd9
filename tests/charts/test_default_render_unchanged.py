"""Opt-in features render nothing until enabled: every conftest scenario that existed before
gateway.inferencePool renders, byte for byte, what main's chart rendered. golden/renders.json holds the
sha256 of each scenario's whole `helm template` output (NOTES.txt included, the random registry token
masked), made from main's chart at 7c9c65e and re-made when engines got `--long-prefill-token-threshold` (0 by
default, the only line that moved), when the router's Role lost `get` on pods (it only lists and watches them) and
when engines got `--max-long-partial-prefills 1` (the only lines that moved);
the same holds with the feature's knobs set but `enabled: false`.

A change meant to alter these renders updates the digests: `python -m tests.charts.test_default_render_unchanged`
(diff against the old render with `git show <commit>:charts/ragserve` to see what moved). The one difference
allowed is spelled out below: the operator's RBAC rules for InferencePools and HTTPRoutes, cut from its render
before hashing (found exactly once, else the test fails)."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import helm_python as helm
import pytest

from tests.charts.conftest import CHART, NAMESPACE, RELEASE, SCENARIOS

GOLDEN = Path(__file__).parent / "golden" / "renders.json"
FROZEN = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
INFERENCE_POOL_OFF = {
    "gateway": {
        "inferencePool": {
            "enabled": False,
            "failureMode": "FailOpen",
            "eppPort": 9102,
            "tls": {"mode": "plaintext"},
            "httpRoute": {"enabled": True, "parentRefs": [{"name": "gw", "namespace": "infra"}]},
        }
    }
}


RANDOM = "ragserve/templates/router/registry-token.yaml"  # its token is randAlphaNum 48: masked
# The one change outside the feature: the operator may be asked for an InferencePool by any RAGServe, so its
# rules (operator.enabled) name what it calls on them (it lists both kinds on every pass, to prune them).
OPERATOR_RBAC = "ragserve/templates/operator/rbac.yaml"
OPERATOR_RULES = """
  - apiGroups: [inference.networking.k8s.io]
    resources: [inferencepools]
    verbs: [get, list, create, patch, delete]
  - apiGroups: [gateway.networking.k8s.io]
    resources: [httproutes]
    verbs: [get, list, create, patch, delete]"""


def digest(chart, values: dict) -> str:
    """sha256 of the whole render: every non-empty file's path and text, in path order (`helm template` prints
    no empty file: a template whose feature is off renders nothing)."""
    out = {p: t for p, t in chart.render(values, name=RELEASE, namespace=NAMESPACE).items() if t.strip()}
    if OPERATOR_RBAC in out:
        assert out[OPERATOR_RBAC].count(OPERATOR_RULES) == 1, "the operator's rules changed"
        out[OPERATOR_RBAC] = out[OPERATOR_RBAC].replace(OPERATOR_RULES, "")
    if RANDOM in out:
        out[RANDOM] = re.sub(r"(?m)^(  \S+: )[A-Za-z0-9+/=]{64}$", r"\1<random>", out[RANDOM])
    text = "".join(f"# Source: {path}\n{out[path]}\n" for path in sorted(out))
    return hashlib.sha256(text.encode()).hexdigest()


def merged(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


@pytest.mark.parametrize("name", sorted(FROZEN))
def test_scenario_renders_what_main_rendered(chart, name: str):
    assert digest(chart, SCENARIOS[name]) == FROZEN[name], f"{name}: the render changed"
    assert digest(chart, merged(SCENARIOS[name], INFERENCE_POOL_OFF)) == FROZEN[name], f"{name}: knobs leak"


def test_every_frozen_scenario_still_exists():
    assert len(FROZEN) >= 13 and set(FROZEN) <= set(SCENARIOS)


if __name__ == "__main__":
    with helm.Chart.load(CHART) as loaded:
        frozen = {name: digest(loaded, values) for name, values in SCENARIOS.items() if name in FROZEN or not FROZEN}
    GOLDEN.write_text(json.dumps(frozen, indent=2, sort_keys=True) + "\n")
