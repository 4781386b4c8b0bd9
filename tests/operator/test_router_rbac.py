"""The router's Kubernetes pod discovery (a real `ragserve router` process, --k8s-selector) against the
in-memory API: the calls it makes are the ones the chart's router Role grants
(charts/ragserve/templates/router/rbac.yaml, rendered with router.kubernetesDiscovery.enabled)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import pytest_asyncio

from tests.helpers.process import start
from tests.helpers.ragserve_cr import NS
from tests.operator import rbac
from tests.operator.conftest import kubeconfig, serving_kube

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]
SELECTOR = "app.kubernetes.io/component=engine"


@pytest_asyncio.fixture
async def router_kube():
    """The API, its calls checked against the router's rules (not the operator's) when it closes."""
    async with serving_kube(check=rbac.check_router_calls) as sim:
        yield sim


async def test_pod_discovery_makes_only_calls_the_router_role_grants(
    router_kube, free_ports, engine_pod, eventually, tmp_path: Path
):
    kube = router_kube
    port, grpc_port, engine_port = free_ports(3)
    await kube.call("POST", f"/api/v1/namespaces/{NS}/pods", engine_pod("engine-0", "a", "rs", engine_port))
    config = kubeconfig(str(kube.url).rstrip("/"), tmp_path / "kubeconfig.yaml")
    argv = [sys.executable, "-m", "ragserve.cli", "router", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--grpc-port", str(grpc_port), "--registry-allow-unauthenticated", "--policy", "round_robin"]
    argv += ["--k8s-selector", SELECTOR, "--k8s-namespace", NS]
    log = tmp_path / "router.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAGSERVE_", "KUBERNETES_"))}
    router = start("router", argv, log, env={**env, "KUBECONFIG": str(config)})
    try:

        def logged(text: str) -> bool:
            assert router.alive(), router.failure("router exited")
            return text in log.read_text()

        await eventually(lambda: logged("pod engine-0 joined the engine pool"), what="listed pod", timeout=60)
        await kube.call("POST", f"/api/v1/namespaces/{NS}/pods", engine_pod("engine-1", "a", "rs", engine_port + 1))
        await eventually(lambda: logged("pod engine-1 joined the engine pool"), what="watched pod", timeout=30)
        await kube.call("DELETE", f"/api/v1/namespaces/{NS}/pods/engine-0")
        await eventually(lambda: logged("pod engine-0 left the engine pool"), what="watched deletion", timeout=30)
    finally:
        await router.stop_async()
    # what discovery needs: list, then watch, pods of its namespace; the rules are checked when the API closes
    assert kube.calls == {("list", "", "pods"), ("watch", "", "pods")}
    rules = rbac.router_rules()
    assert all(rbac.allows(rules, c) for c in kube.calls)
