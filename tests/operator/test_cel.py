"""Every x-kubernetes-validations rule of the CRDs, evaluated by a real CEL evaluator (cel-python) on
defaulted valid and invalid objects, next to the operator's Python mirrors of the same rules: a wrong
expression or a wrong mirror fails here, not on a cluster.

As the API server does: a rule runs on the value at its node (every item of a list), after defaulting,
with `self` bound to it and `oldSelf` to the previous value (transition rules run on updates only).
The rules use only standard CEL (size, matches, has) — no Kubernetes CEL library function (quantity,
isURL, ...) is needed; one added would fail every case here (cel-python has none of them) until the
harness implements it."""

from __future__ import annotations

import copy

import pytest

from ragserve_operator.crd import crds
from ragserve_operator.spec import CROSS_FIELD_RULES, POOL_RULES, SpecError, apply_defaults, check_name, spec_schema
from tests.helpers.cel import ENV, Rule, holds, rules_of, values_at


def all_rules() -> list[Rule]:
    return [r for c in crds() for r in rules_of(c["spec"]["versions"][0]["schema"]["openAPIV3Schema"])]


def cel_failures(obj: dict, old: dict | None = None) -> set[str]:
    """The messages of the rules `obj` (a whole RAGServe, defaulted) breaks."""
    failed = set()
    for path, rule in all_rules():
        olds = values_at(old, path) if old is not None else []
        for i, value in enumerate(values_at(obj, path)):
            if not holds(rule["rule"], value, olds[i] if i < len(olds) else None):
                failed.add(rule["message"])
    return failed


def mirror_failures(obj: dict) -> set[str]:
    """The same, by the operator's Python mirrors (spec.py)."""
    spec = obj["spec"]
    failed = {m for m, ok in CROSS_FIELD_RULES if not ok(spec)}
    failed |= {m for m, ok in POOL_RULES for pool in spec["engines"] if not ok(pool)}
    try:
        check_name(obj["metadata"]["name"])
    except SpecError:
        failed.add(NAME)
    return failed


def ragserve(spec: dict, name: str = "demo") -> dict:
    spec = apply_defaults(spec_schema(), copy.deepcopy(spec))
    return {"apiVersion": "ragserve.dev/v1alpha1", "kind": "RAGServe", "metadata": {"name": name}, "spec": spec}


POOL = {"name": "a", "model": "m"}
NAME = "metadata.name must be a DNS-1035 label of at most 31 characters (it prefixes the names of the children)"
SHARED = "router.replicas > 1 needs shared state: set redis.mode to inCluster or external"
PREFILLER = (
    "prefiller is for role decode pools (the prefill leg a decode engine runs on the prefill engine the endpoint "
    "picker names)"
)
TIER = "cachestore.redisTier needs a Redis: set redis.mode to inCluster or external"
CASES: list[tuple[str, dict, str, set[str]]] = [
    ("minimal", {"engines": [POOL]}, "demo", set()),
    ("name uppercase", {"engines": [POOL]}, "Demo", {NAME}),
    ("name too long", {"engines": [POOL]}, "a" * 32, {NAME}),
    ("name of 31", {"engines": [POOL]}, "a" * 31, set()),
    ("name ends in -", {"engines": [POOL]}, "demo-", {NAME}),
    ("name starts with a digit", {"engines": [POOL]}, "1demo", {NAME}),
    ("two routers, no redis", {"engines": [POOL], "router": {"replicas": 2}}, "demo", {SHARED}),
    (
        "two routers, redis",
        {"engines": [POOL], "router": {"replicas": 2}, "redis": {"mode": "inCluster"}},
        "demo",
        set(),
    ),
    ("redis tier, no redis", {"engines": [POOL], "cachestore": {"redisTier": True}}, "demo", {TIER}),
    (
        "redis tier and two routers",
        {"engines": [POOL], "router": {"replicas": 3}, "cachestore": {"redisTier": True}},
        "demo",
        {SHARED, TIER},
    ),
    (
        "external redis, no url",
        {"engines": [POOL], "redis": {"mode": "external"}},
        "demo",
        {"redis.mode external needs redis.url or redis.urlSecret"},
    ),
    ("external redis, url", {"engines": [POOL], "redis": {"mode": "external", "url": "redis://r:6379"}}, "demo", set()),
    (
        "external redis, secret",
        {"engines": [POOL], "redis": {"mode": "external", "urlSecret": {"name": "r", "key": "u"}}},
        "demo",
        set(),
    ),
    (
        "pool min > max",
        {"engines": [POOL, {"name": "b", "model": "m", "minReplicas": 3, "maxReplicas": 2}]},
        "demo",
        {"minReplicas must be <= maxReplicas"},
    ),
    ("pool min = max", {"engines": [{**POOL, "minReplicas": 2, "maxReplicas": 2}]}, "demo", set()),
    (
        "decode pool, prefiller",
        {"engines": [{**POOL, "role": "decode", "prefiller": {"allow": ["10.0.0.0/8"], "timeout": 5}}]},
        "demo",
        set(),
    ),
    ("both pool, prefiller", {"engines": [{**POOL, "prefiller": {"allow": ["10.0.0.0/8"]}}]}, "demo", {PREFILLER}),
    ("prefill pool, prefiller", {"engines": [{**POOL, "role": "prefill", "prefiller": {}}]}, "demo", {PREFILLER}),
]
VLLM = {"name": "v", "model": "/models/llama", "runtime": "vllm", "gpus": 1}
TOKENIZER = {"tokenizer": {"path": "/tokenizer"}}
NO_TOKENIZER = (
    "runtime vllm pools need router.tokenizer.path (the model's tokenizer.json dir or .gguf, for the router's "
    "--tokenizer)"
)
ONE_BLOCK = "runtime vllm pools need one vllm.blockSize (the router has one --external-block-size)"
CASES += [
    ("vllm pool", {"engines": [POOL, VLLM], "router": TOKENIZER}, "demo", set()),
    ("vllm pool, no tokenizer", {"engines": [VLLM]}, "demo", {NO_TOKENIZER}),
    ("vllm pool, empty tokenizer", {"engines": [VLLM], "router": {"tokenizer": {"path": ""}}}, "demo", {NO_TOKENIZER}),
    (
        "vllm pool, no gpu",
        {"engines": [{**VLLM, "gpus": 0}], "router": TOKENIZER},
        "demo",
        {"runtime vllm needs gpus >= 1 (the vllm/vllm-openai image is CUDA)"},
    ),
    ("ragserve pool, no gpu, no tokenizer", {"engines": [{**POOL, "gpus": 0}]}, "demo", set()),
    (
        "vllm pools, one block size",
        {"engines": [VLLM, {**VLLM, "name": "w", "vllm": {"blockSize": 16}}], "router": TOKENIZER},
        "demo",
        set(),
    ),
    (
        "vllm pools, two block sizes",
        {"engines": [VLLM, {**VLLM, "name": "w", "vllm": {"blockSize": 32}}], "router": TOKENIZER},
        "demo",
        {ONE_BLOCK},
    ),
    (
        "two block sizes, one of a ragserve pool",
        {"engines": [VLLM, {**POOL, "vllm": {"blockSize": 32}}], "router": TOKENIZER},
        "demo",
        set(),
    ),
]
ON = {"enabled": True}
GW_VLLM = (
    "gateway.inferencePool: runtime vllm pools cannot be InferencePool members (the EPP may only pick members): "
    "serve them through the router's own API"
)
GW_SECRET = "gateway.inferencePool.tls.mode secret needs tls.secretName"
GW_PARENTS = "gateway.inferencePool.httpRoute needs parentRefs (the Gateway to attach to)"
ROUTE = {"enabled": True, "parentRefs": [{"name": "gw"}]}
CASES += [
    ("inference pool", {"engines": [POOL], "gateway": {"inferencePool": {**ON, "httpRoute": ROUTE}}}, "demo", set()),
    (
        "inference pool, vllm pool",
        {"engines": [POOL, VLLM], "router": TOKENIZER, "gateway": {"inferencePool": ON}},
        "demo",
        {GW_VLLM},
    ),
    ("no inference pool, vllm pool", {"engines": [VLLM], "router": TOKENIZER, "gateway": {}}, "demo", set()),
    (
        "inference pool, secret tls, no secret",
        {"engines": [POOL], "gateway": {"inferencePool": {**ON, "tls": {"mode": "secret"}}}},
        "demo",
        {GW_SECRET},
    ),
    (
        "inference pool, secret tls",
        {"engines": [POOL], "gateway": {"inferencePool": {**ON, "tls": {"mode": "secret", "secretName": "e"}}}},
        "demo",
        set(),
    ),
    (
        "inference pool off, secret tls, no secret",
        {"engines": [POOL], "gateway": {"inferencePool": {"tls": {"mode": "secret"}}}},
        "demo",
        set(),
    ),
    (
        "inference pool, route without parents",
        {"engines": [POOL], "gateway": {"inferencePool": {**ON, "httpRoute": {"enabled": True}}}},
        "demo",
        {GW_PARENTS},
    ),
]
for part in ("router", "cachestore"):
    CASES += [
        (
            f"{part} tls, no secret",
            {"engines": [POOL], part: {"tls": {"enabled": True}}},
            "demo",
            {f"{part}.tls.enabled needs {part}.tls.secretName"},
        ),
        (
            f"{part} tls, empty secret",
            {"engines": [POOL], part: {"tls": {"enabled": True, "secretName": ""}}},
            "demo",
            {f"{part}.tls.enabled needs {part}.tls.secretName"},
        ),
        (f"{part} tls", {"engines": [POOL], part: {"tls": {"enabled": True, "secretName": "t"}}}, "demo", set()),
        (
            f"{part} client auth, no secret",
            {"engines": [POOL], part: {"tls": {"enabled": True, "secretName": "t", "clientAuth": True}}},
            "demo",
            {f"{part}.tls.clientAuth needs {part}.tls.engineClientSecret"},
        ),
        (
            f"{part} client auth",
            {
                "engines": [POOL],
                part: {"tls": {"enabled": True, "secretName": "t", "clientAuth": True, "engineClientSecret": "c"}},
            },
            "demo",
            set(),
        ),
    ]

HTTPS_SECRET = "router.httpTls.enabled needs router.httpTls.secretName"
CASES += [
    ("router https, no secret", {"engines": [POOL], "router": {"httpTls": {"enabled": True}}}, "demo", {HTTPS_SECRET}),
    ("router https", {"engines": [POOL], "router": {"httpTls": {"enabled": True, "secretName": "t"}}}, "demo", set()),
]
ENGINE_SECRET, ENGINE_ENABLED = "httpTls.enabled needs httpTls.secretName", "httpTls.clientAuth needs httpTls.enabled"
ENGINE_CLIENT = (
    "engines[].httpTls.clientAuth needs router.engineTls.clientSecret (the client certificate the router presents)"
)
ENGINE_VLLM = "httpTls is for runtime ragserve pools (a vllm pool: vLLM's --ssl-* flags in vllm.extraArgs)"
ENGINE_GW = "engines[].httpTls: gateway.inferencePool sends the gateway's traffic to engine pods over plain HTTP"
HTTPS_POOL = {**POOL, "httpTls": {"enabled": True, "secretName": "e"}}
MTLS_POOL = {**POOL, "httpTls": {"enabled": True, "secretName": "e", "clientAuth": True}}
CASES += [
    ("engine https", {"engines": [HTTPS_POOL]}, "demo", set()),
    ("engine https, no secret", {"engines": [{**POOL, "httpTls": {"enabled": True}}]}, "demo", {ENGINE_SECRET}),
    (
        "engine client auth, no https",
        {"engines": [{**POOL, "httpTls": {"clientAuth": True}}]},
        "demo",
        {ENGINE_ENABLED, ENGINE_CLIENT},
    ),
    ("engine mtls, no router cert", {"engines": [MTLS_POOL]}, "demo", {ENGINE_CLIENT}),
    ("engine mtls", {"engines": [MTLS_POOL], "router": {"engineTls": {"clientSecret": "c"}}}, "demo", set()),
    (
        "engine https on vllm",
        {"engines": [{**VLLM, "httpTls": {"enabled": True, "secretName": "e"}}], "router": TOKENIZER},
        "demo",
        {ENGINE_VLLM},
    ),
    (
        "engine https behind the gateway",
        {"engines": [HTTPS_POOL], "gateway": {"inferencePool": ON}},
        "demo",
        {ENGINE_GW},
    ),
]


@pytest.mark.parametrize("spec, name, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_cel_rules_and_their_python_mirrors_agree(spec: dict, name: str, expected: set[str]):
    obj = ragserve(spec, name)
    assert cel_failures(obj) == expected
    assert mirror_failures(obj) == expected


def test_every_rule_has_a_case_that_breaks_it_and_one_that_keeps_it():
    broken = set().union(*(expected for *_, expected in CASES))
    assert broken == {rule["message"] for _, rule in all_rules()}
    assert [spec for _, spec, _, expected in CASES if not expected]  # and valid objects pass every rule


def test_every_rule_compiles_with_standard_cel():
    for path, rule in all_rules():
        ENV.compile(rule["rule"])  # raises on a syntax error
        assert rule["message"], path


def test_transition_rules_see_old_self():
    """The harness binds oldSelf as the API server does (no rule uses it yet: this keeps the harness honest)."""
    rule = "self.replicas >= oldSelf.replicas"
    assert holds(rule, {"replicas": 2}, {"replicas": 1}) and not holds(rule, {"replicas": 1}, {"replicas": 2})
    assert holds(rule, {"replicas": 1})  # a create: transition rules are not run
