"""engines[].httpTls and router.engineTls: HTTPS on the engines' ports and mutual TLS from the router to them.
The Secrets are mounted where the flags point, the probes and the pods' discovery annotation follow the scheme,
the PodMonitor scrapes https pools with the router's engine certificates, and contradictions fail the render."""

from __future__ import annotations

import argparse

import pytest

from tests.charts.test_args import parse
from tests.charts.test_engine_command import EXTRA, FULLNAME

HTTPS = EXTRA["https-pools"]  # pools https, mtls (clientAuth) and plain; the router has a client certificate
ROUTER_SIDE = {"engineTls": {"caSecret": "engine-ca", "clientSecret": "router-client"}}


def pod_spec(docs: list[dict], name: str) -> dict:
    (deployment,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == f"{FULLNAME}-{name}"]
    return deployment["spec"]["template"]


def engine(docs: list[dict], pool: str) -> tuple[dict, dict]:
    """(pod template metadata, engine container) of a pool's Deployment."""
    template = pod_spec(docs, f"engine-{pool}")
    (container,) = [c for c in template["spec"]["containers"] if c["name"] == "engine"]
    return template, container


def parsed(container: dict) -> argparse.Namespace:
    ns = parse(container["args"])
    assert isinstance(ns, argparse.Namespace), ns
    return ns


def test_https_pool_mounts_its_secret_probes_https_and_is_annotated(render):
    template, container = engine(render(HTTPS), "https")
    volume = next(v for v in template["spec"]["volumes"] if v["name"] == "http-tls")
    assert volume["secret"]["secretName"] == "engine-https"
    assert {"name": "http-tls", "mountPath": "/etc/ragserve/http-tls", "readOnly": True} in container["volumeMounts"]
    ns = parsed(container)  # the real `ragserve engine` parser
    assert (ns.tls_cert_file, ns.tls_key_file) == ("/etc/ragserve/http-tls/tls.crt", "/etc/ragserve/http-tls/tls.key")
    assert ns.tls_client_ca_file is None
    assert ns.advertise_url == "https://$(POD_IP):8000"
    assert template["metadata"]["annotations"]["ragserve.io/scheme"] == "https"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["scheme"] == "HTTPS"


def test_client_auth_pool_requires_the_ca_and_probes_the_port(render):
    """The kubelet presents no client certificate: under clientAuth the probes are TCP checks."""
    template, container = engine(render(HTTPS), "mtls")
    assert parsed(container).tls_client_ca_file == "/etc/ragserve/http-tls/ca.crt"
    assert template["metadata"]["annotations"]["ragserve.io/scheme"] == "https"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["tcpSocket"] == {"port": "http"} and "httpGet" not in container[probe]


def test_a_pool_can_opt_out(render):
    template, container = engine(render(HTTPS), "plain")
    ns = parsed(container)
    assert ns.tls_cert_file is None and ns.advertise_url == "http://$(POD_IP):8000"
    assert "ragserve.io/scheme" not in template["metadata"]["annotations"]
    assert "http-tls" not in {v["name"] for v in template["spec"]["volumes"]}
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}


def test_router_mounts_the_engine_ca_and_its_client_certificate(render):
    template = pod_spec(render({"router": ROUTER_SIDE}), "router")
    (container,) = template["spec"]["containers"]
    volumes = {v["name"]: v.get("secret") for v in template["spec"]["volumes"]}
    assert volumes["engine-ca"] == {"secretName": "engine-ca", "items": [{"key": "ca.crt", "path": "ca.crt"}]}
    assert volumes["engine-client"]["secretName"] == "router-client"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["engine-ca"] == "/etc/ragserve/engine-ca" and mounts["engine-client"] == "/etc/ragserve/engine-client"
    ns = parsed(container)  # the real `ragserve router` parser
    assert ns.engine_ca_file == "/etc/ragserve/engine-ca/ca.crt"
    assert ns.engine_client_cert_file == "/etc/ragserve/engine-client/tls.crt"
    assert ns.engine_client_key_file == "/etc/ragserve/engine-client/tls.key"


def test_pod_monitor_scrapes_https_pools_with_the_routers_certificates(render):
    values = {**HTTPS, "router": ROUTER_SIDE, "monitoring": {"monitors": {"enabled": True}}}
    (monitor,) = [d for d in render(values) if d["kind"] == "PodMonitor"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["tlsConfig"] == {
        "ca": {"secret": {"name": "engine-ca", "key": "ca.crt"}},
        "cert": {"secret": {"name": "router-client", "key": "tls.crt"}},
        "keySecret": {"name": "router-client", "key": "tls.key"},
    }
    scheme = {"sourceLabels": ["__meta_kubernetes_pod_annotation_ragserve_io_scheme"], "regex": "(https)"}
    assert {**scheme, "targetLabel": "__scheme__"} in endpoint["relabelings"]


def test_pod_monitor_is_unchanged_without_https_pools(render):
    (monitor,) = [d for d in render({"monitoring": {"monitors": {"enabled": True}}}) if d["kind"] == "PodMonitor"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert "tlsConfig" not in endpoint and len(endpoint["relabelings"]) == 1


MTLS_POOL = {"name": "a", "model": "m", "httpTls": {"enabled": True, "secretName": "s", "clientAuth": True}}
CONFLICTS = [
    ({"engines": [{"name": "a", "model": "m", "httpTls": {"enabled": True}}]}, "engines[a].httpTls.enabled needs"),
    ({"engines": [MTLS_POOL]}, "engines[a].httpTls.clientAuth needs router.engineTls.clientSecret"),
    ({"engines": [{"name": "a", "model": "m", "httpTls": {"clientAuth": True}}]}, "clientAuth needs httpTls.enabled"),
    (
        {"engines": [{**MTLS_POOL, "runtime": "vllm"}], "router": ROUTER_SIDE},
        "engines[a].httpTls is for runtime ragserve pools",
    ),
    (
        {"engines": [MTLS_POOL], "router": ROUTER_SIDE, "gateway": {"inferencePool": {"enabled": True}}},
        "gateway.inferencePool sends the gateway's traffic to engine pods over plain HTTP",
    ),
]


@pytest.mark.parametrize(("values", "message"), CONFLICTS)
def test_contradictions_fail_the_render_with_a_message(render_fails, values, message):
    render_fails(values, message)


def test_client_auth_without_a_router_needs_no_router_certificate(render):
    template, container = engine(render({"engines": [MTLS_POOL], "router": {"enabled": False}}), "a")
    assert parsed(container).tls_client_ca_file == "/etc/ragserve/http-tls/ca.crt"
