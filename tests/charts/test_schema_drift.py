"""The chart's values cannot drift from the code: values.yaml's engineDefaults.engine and the
values.schema.json that constrains it have the keys, defaults and allowed values of ragserve.engine_args
(the same source the RAGServe CRD is generated from); log levels, routing policies and the router's defaults
are the code's (ragserve.router_args), and so are the cachestore's (ragserve.cachestore_args)."""

from __future__ import annotations

import json

import yaml

from ragserve import cachestore_args, router_args
from ragserve.cachestore_args import CACHESTORE_METRICS_PORT
from ragserve.engine_args import BLOCK_SIZES, EngineConfig, spec_options
from ragserve.flags import flag_of
from ragserve.logs import LOG_LEVELS
from ragserve.router_args import DEFAULT_POLICY, POLICIES, RouterConfig
from ragserve_operator.crd import crd


def engine_schema(chart_dir) -> dict:
    schema = json.loads((chart_dir / "values.schema.json").read_text())
    return schema["definitions"]["enginePool"]["properties"]["engine"]["properties"]


def test_values_have_every_engine_setting_with_the_engines_default(chart_dir):
    values = yaml.safe_load((chart_dir / "values.yaml").read_text())["engineDefaults"]["engine"]
    assert list(values) == [key for key, _ in spec_options()]
    for key, f in spec_options():
        assert values[key] == getattr(EngineConfig(), f.name), key


def test_schema_allows_what_the_engine_allows(chart_dir):
    schema = engine_schema(chart_dir)
    assert list(schema) == [key for key, _ in spec_options()]
    assert schema["blockSize"]["enum"] == list(BLOCK_SIZES)
    for key, f in spec_options():
        expected = f.metadata["choices"] or f.metadata["schema"].get("enum")
        assert schema[key].get("enum") == (list(expected) if expected else None), key
        if "minimum" in f.metadata["schema"]:
            assert schema[key]["minimum"] == f.metadata["schema"]["minimum"], key


def test_log_levels_and_routing_policies_are_the_codes(chart_dir):
    schema = json.loads((chart_dir / "values.schema.json").read_text())["properties"]
    assert schema["logLevel"]["enum"] == list(LOG_LEVELS)
    assert schema["router"]["properties"]["policy"]["enum"] == list(POLICIES)


def test_router_values_have_the_routers_defaults(chart_dir):
    """values.yaml's router.policy, port and grpcPort (the CRD's spec.router settings) are RouterConfig's defaults."""
    values = yaml.safe_load((chart_dir / "values.yaml").read_text())["router"]
    assert values["policy"] == DEFAULT_POLICY
    for key, f in router_args.spec_options():
        assert values[key] == getattr(RouterConfig(), f.name), key


def test_cachestore_values_have_the_cachestores_defaults(chart_dir):
    """values.yaml's cachestore port and memory (the CRD's spec.cachestore settings) and its metrics port are
    the `ragserve cachestore` flags' defaults."""
    values = yaml.safe_load((chart_dir / "values.yaml").read_text())["cachestore"]
    for key, f in cachestore_args.spec_options():
        assert values[key] == f.default, key
    assert values["metricsPort"] == CACHESTORE_METRICS_PORT


def test_router_setting_groups_are_the_routers_flags(chart_dir):
    """router.flowControl, .tenantQuotas, .breaker, .retry, .health: in values.yaml (null: the router's default),
    values.schema.json and the CRD, the keys and types of router_args.SETTING_GROUPS."""
    values = yaml.safe_load((chart_dir / "values.yaml").read_text())["router"]
    schema = json.loads((chart_dir / "values.schema.json").read_text())["properties"]["router"]["properties"]
    crd_router = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["router"]
    for group, keys in router_args.group_options():
        assert values[group] == {key: None for key, _ in keys}, group
        assert list(schema[group]["properties"]) == [key for key, _ in keys], group
        crd_props = crd_router["properties"][group]["properties"]
        for key, f in keys:
            assert schema[group]["properties"][key]["type"] == [crd_props[key]["type"], "null"], key
            assert "default" not in crd_props[key] and crd_props[key]["description"].startswith(flag_of(f.name))
