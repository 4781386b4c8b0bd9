"""Kubernetes pod discovery against kmock, an in-memory Kubernetes API server on loopback; the pods are
real engines."""

from __future__ import annotations

import httpx
import kmock
import pytest

from ragserve_router.k8s import matches, parse_selector, pod_engine
from tests.helpers.process import until_async

NS = "ragserve"


def pod(name: str, port: int, ready: bool = True, app: str = "ragserve-engine") -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": {"app": app},
            "annotations": {"ragserve.io/port": str(port)},
        },
        "status": {
            "phase": "Running",
            "podIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def test_selector_parsing_and_matching():
    terms = parse_selector("app=ragserve-engine, tier!=canary,gpu")
    assert matches({"app": "ragserve-engine", "gpu": "h100"}, terms)
    assert not matches({"app": "ragserve-engine", "gpu": "h100", "tier": "canary"}, terms)
    assert not matches({"app": "ragserve-engine"}, terms)
    with pytest.raises(ValueError, match="invalid --k8s-selector"):
        parse_selector(" , ")


def test_only_running_ready_pods_are_engines():
    assert pod_engine(pod("a", 9000), 8000).url == "http://127.0.0.1:9000"
    assert pod_engine(pod("a", 9000, ready=False), 8000) is None
    terminating = pod("a", 9000)
    terminating["metadata"]["deletionTimestamp"] = "2024-01-01T00:00:00Z"
    assert pod_engine(terminating, 8000) is None
    v6 = pod("b", 9000)
    v6["metadata"]["annotations"] = {}
    v6["status"]["podIP"] = "fd00::5"
    assert pod_engine(v6, 8000).url == "http://[fd00::5]:8000"
    v6["metadata"]["annotations"] = {"ragserve.io/scheme": "https"}  # an engine serving TLS
    assert pod_engine(v6, 8000).url == "https://[fd00::5]:8000"


@pytest.mark.asyncio
async def test_router_follows_ready_pods(kmock: kmock.KubernetesEmulator, cluster, fleet, tmp_path):
    kmock.resources["v1/pods"] = {}
    e0, e1 = fleet.engines[:2]
    api = httpx.AsyncClient(base_url=str(kmock.url))
    await api.post(f"/api/v1/namespaces/{NS}/pods", json=pod("engine-0", e0.port))
    await api.post(f"/api/v1/namespaces/{NS}/pods", json=pod("engine-1", e1.port, ready=False))
    await api.post(f"/api/v1/namespaces/{NS}/pods", json=pod("unrelated", e1.port, app="other"))
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: t\n"
        f"clusters: [{{name: k, cluster: {{server: '{kmock.url}'}}}}]\n"
        "users: [{name: u, user: {token: test}}]\n"
        "contexts: [{name: t, context: {cluster: k, user: u}}]\n"
    )
    router = cluster.router(
        "--k8s-selector",
        "app=ragserve-engine",
        "--k8s-namespace",
        NS,
        "--policy",
        "round_robin",
        env={"KUBECONFIG": str(kubeconfig)},
        wait=False,
    )
    client = httpx.AsyncClient(base_url=router.url, timeout=30)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    async def status():
        try:
            return (await client.get("/ready")).json()
        except httpx.HTTPError:
            return {}

    async def served_by(n: int) -> set[str]:
        resps = [await client.post("/v1/chat/completions", json=body) for _ in range(n)]
        assert all(r.json()["usage"]["completion_tokens"] == 2 for r in resps)  # real generations
        return {r.headers["x-ragserve-engine"] for r in resps}

    try:
        await until_async(lambda: _eq(status(), engines=1, healthy_engines=1), what="one ready pod")
        assert await served_by(4) == {"engine-0"}
        await api.patch(
            f"/api/v1/namespaces/{NS}/pods/engine-1",
            json={"status": {"conditions": [{"type": "Ready", "status": "True"}]}},
        )
        await until_async(lambda: _eq(status(), engines=2, healthy_engines=2), what="both pods")
        assert await served_by(4) == {"engine-0", "engine-1"}
        await api.delete(f"/api/v1/namespaces/{NS}/pods/engine-0")
        await until_async(lambda: _eq(status(), engines=1), what="deleted pod gone")
        assert await served_by(4) == {"engine-1"}
    finally:
        await client.aclose()
        await api.aclose()
        assert router.alive(), router.output()


async def _eq(coro, **expected) -> bool:
    got = await coro
    return all(got.get(k) == v for k, v in expected.items())
