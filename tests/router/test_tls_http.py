"""TLS on the HTTP ports: the router serves HTTPS to clients that verify it; an engine that requires client
certificates refuses a client without one (or with one from another CA) and serves the router, which presents
its own, at the https:// URL the engine registered. Real processes, certificates from tests/helpers/pki.py."""

from __future__ import annotations

import ssl

import httpx
import pytest

from ragserve.tls import client_ssl
from tests.helpers import process
from tests.helpers.net import free_port
from tests.helpers.pki import write_test_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict:
    return {k: str(v) for k, v in write_test_pki(tmp_path_factory.mktemp("pki")).items()}


def answers(url: str, verify: ssl.SSLContext, ok=lambda r: r.status_code == 200) -> bool:
    try:
        return ok(httpx.get(url, verify=verify, timeout=5))
    except httpx.HTTPError:
        return False


def test_router_serves_https_to_clients_that_verify_it(cluster, pki):
    router = cluster.router("--tls-cert-file", pki["server_cert"], "--tls-key-file", pki["server_key"], wait=False)
    https = f"https://127.0.0.1:{router.port}"
    trusting = client_ssl(pki["ca"])
    process.until(lambda: answers(https + "/health", trusting), timeout=60, what="router on https", proc=router)
    assert httpx.get(https + "/v1/models", verify=trusting, timeout=5).json()["object"] == "list"
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(https + "/health", verify=client_ssl(pki["rogue_ca"]), timeout=5)  # a server it cannot verify
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{router.port}/health", timeout=5)  # no plaintext on the TLS port


def test_engine_requires_client_certificates_and_serves_the_router_that_has_one(cluster, pki):
    engine_tls = ["--tls-cert-file", pki["server_cert"], "--tls-key-file", pki["server_key"]]
    engine_tls += ["--tls-client-ca-file", pki["ca"]]
    router_tls = ["--engine-ca-file", pki["ca"], "--engine-client-cert-file", pki["client_cert"]]
    router = cluster.router(
        *router_tls, "--engine-client-key-file", pki["client_key"], "--heartbeat-interval-ms", "300"
    )
    port = free_port()
    https = f"https://127.0.0.1:{port}"
    (engine,) = cluster.real_engines(router, 1, *engine_tls, "--advertise-url", https, ports=[port], ids=["tls-engine"],
                                     wait=False)  # fmt: skip
    with_cert = client_ssl(pki["ca"], pki["client_cert"], pki["client_key"])

    def registered(r: httpx.Response) -> bool:
        return r.status_code == 200 and r.json().get("registered") is True

    process.until(lambda: answers(https + "/ready", with_cert, registered), timeout=300, what="engine registered",
                  proc=engine)  # fmt: skip
    for refused in (client_ssl(pki["ca"]), client_ssl(pki["ca"], pki["rogue_client_cert"], pki["rogue_client_key"])):
        with pytest.raises(httpx.HTTPError):  # the handshake fails (TLS 1.3: on the first read)
            httpx.get(https + "/health", verify=refused, timeout=5)
    assert httpx.get(f"{router.url}/ready", timeout=5).json()["healthy_engines"] == 1
    body = {"model": "tiny", "prompt": "Hello over TLS", "max_tokens": 3}
    resp = httpx.post(router.url + "/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-ragserve-engine"] == "tls-engine" and resp.json()["choices"][0]["text"]
    chunks = []
    with httpx.stream("POST", router.url + "/v1/completions", json={**body, "stream": True}, timeout=120) as stream:
        chunks = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert chunks[-1] == "data: [DONE]" and len(chunks) >= 2
