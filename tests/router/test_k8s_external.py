"""--external-k8s-selector: a real `ragserve router` process discovers external (vLLM) engine pods in the
in-memory Kubernetes API (KubeSim, its calls checked against the chart's router Role) and follows their KV
events from real publishers on loopback; the index is the router's Redis state, read here directly."""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ragserve.external_engine import ExternalEngineSpec
from ragserve.vllm_events import BlockStored, ZmqEventPublisher
from ragserve_router.k8s import pod_external_spec
from ragserve_router.redis_state import RedisState
from tests.helpers.net import free_port, free_ports
from tests.helpers.process import start, until_async
from tests.helpers.ragserve_cr import NS
from tests.operator import rbac
from tests.operator.conftest import kubeconfig, serving_kube

BS = 16
APP = {"app": "vllm"}


def vllm_pod(
    name: str,
    ports: dict[str, int],
    annotations: dict[str, str] | None = None,
    ready: bool = True,
    ip: str = "127.0.0.1",
    labels: dict[str, str] = APP,
) -> dict:
    """A vLLM pod: its container ports by name, on `ip`."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": dict(labels), "annotations": dict(annotations or {})},
        "spec": {
            "containers": [{"name": "vllm", "ports": [{"name": n, "containerPort": p} for n, p in ports.items()]}]
        },
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def test_pod_ports_from_names_annotations_and_defaults():
    named = vllm_pod("a", {"http": 9000, "kv-events": 7000, "kv-replay": 7001})
    assert pod_external_spec(named) == ExternalEngineSpec(
        "http://127.0.0.1:9000", "tcp://127.0.0.1:7000", "tcp://127.0.0.1:7001", 1
    )
    annotated = vllm_pod(
        "b",
        {"http": 9000, "kv-events": 7000},
        {
            "ragserve.io/port": "9100",
            "ragserve.io/kv-events-port": "7100",
            "ragserve.io/kv-replay-port": "7101",
            "ragserve.io/data-parallel-size": "2",
        },
    )
    assert pod_external_spec(annotated) == ExternalEngineSpec(
        "http://127.0.0.1:9100", "tcp://127.0.0.1:7100", "tcp://127.0.0.1:7101", 2
    )
    # vLLM's defaults: HTTP 8000, events 5557; a replay socket only when the pod declares one
    bare = vllm_pod("c", {}, ip="fd00::5")
    assert pod_external_spec(bare) == ExternalEngineSpec("http://[fd00::5]:8000", "tcp://[fd00::5]:5557", None, 1)
    assert pod_external_spec(vllm_pod("d", {"http": 9000}, ready=False)) is None
    with pytest.raises(ValueError, match="data-parallel-size"):
        pod_external_spec(vllm_pod("e", {}, {"ragserve.io/data-parallel-size": "0"}))
    with pytest.raises(ValueError, match="is not a port"):
        pod_external_spec(vllm_pod("f", {}, {"ragserve.io/kv-events-port": "http"}))


class Publisher:
    """A vLLM engine's KV-event publisher (PUB and replay) bound on loopback free ports."""

    def __init__(self) -> None:
        self.pub_port, self.replay_port = free_ports(2)
        self.pub = ZmqEventPublisher(
            f"tcp://127.0.0.1:{self.pub_port}", f"tcp://127.0.0.1:{self.replay_port}", bind=True
        )

    def store(self, blocks: int, base: int) -> None:
        tokens = [(base + i) % 1000 + 1 for i in range(blocks * BS)]
        self.pub.publish_events([BlockStored([base + i for i in range(blocks)], None, tokens, BS, None, "GPU", None)])


def kv_stored(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "ragserve_router_kv_events_total" and s.labels.get("kind") == "stored"
    )


@pytest.mark.asyncio
@pytest.mark.timeout(180)
async def test_router_follows_external_engine_pods(cluster, model_dir, tmp_path: Path):
    redis_url, prefix = cluster.redis(), f"k8sx-{uuid.uuid4().hex[:8]}:"
    state = RedisState(redis_url, prefix)
    pubs = {name: Publisher() for name in ("a", "b", "c")}
    a, b, c = pubs["a"], pubs["b"], pubs["c"]
    router = None
    async with serving_kube(check=rbac.check_router_calls) as kube:
        pods = f"/api/v1/namespaces/{NS}/pods"
        # a: named ports; b: not ready yet; c: its named kv ports are wrong, the annotations right;
        # d: ready, publishing, but not selected
        await kube.call("POST", pods, vllm_pod("vllm-a", {"http": free_port(), "kv-events": a.pub_port,
                                                          "kv-replay": a.replay_port}))  # fmt: skip
        await kube.call("POST", pods, vllm_pod("vllm-b", {"http": free_port(), "kv-events": b.pub_port,
                                                          "kv-replay": b.replay_port},
                                               ready=False))  # fmt: skip
        overrides = {"ragserve.io/kv-events-port": str(c.pub_port), "ragserve.io/kv-replay-port": str(c.replay_port)}
        overrides["ragserve.io/port"] = str(free_port())
        await kube.call("POST", pods, vllm_pod("vllm-c", {"http": 1, "kv-events": 1, "kv-replay": 2}, overrides))
        await kube.call("POST", pods, vllm_pod("other", {"kv-events": a.pub_port}, labels={"app": "other"}))
        config = kubeconfig(str(kube.url).rstrip("/"), tmp_path / "kubeconfig.yaml")
        port = free_port()
        argv = [sys.executable, "-m", "ragserve.cli", "router", "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--grpc-port", str(free_port()), "--registry-allow-unauthenticated", "--probe-interval", "0.5"]
        argv += ["--external-k8s-selector", "app=vllm", "--k8s-namespace", NS, "--tokenizer", str(model_dir)]
        argv += ["--redis", redis_url, "--redis-prefix", prefix]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAGSERVE_", "KUBERNETES_"))}
        log = tmp_path / "router.log"
        router = start("router", argv, log, env={**env, "KUBECONFIG": str(config)})
        url = f"http://127.0.0.1:{port}"

        def logged(text: str) -> bool:
            assert router.alive(), router.failure("router exited")
            return text in log.read_text()

        async def blocks(engine: str, expected: int) -> bool:
            assert router.alive(), router.failure("router exited")
            return await state.num_blocks(engine) == expected

        async def engines(expected: int) -> bool:
            try:
                return httpx.get(url + "/ready", timeout=5).json()["engines"] == expected
            except httpx.HTTPError:
                return False

        try:
            for name in ("vllm-a", "vllm-c"):
                await until_async(lambda n=name: logged(f"external pod {n} joined"), what=f"{name} followed",
                                  timeout=60)  # fmt: skip
            await until_async(lambda: engines(2), what="two engines in the pool", timeout=30)
            a.store(3, 100)
            c.store(2, 200)
            b.store(4, 300)
            await until_async(lambda: blocks("external-vllm-a", 3), what="a's blocks in the index", timeout=30)
            await until_async(lambda: blocks("external-vllm-c", 2), what="c's blocks (annotated ports)", timeout=30)
            await until_async(lambda: kv_stored(url) >= 2, what="stored ops counted (one per BlockStored)", timeout=30)
            assert await state.num_blocks("external-vllm-b") == 0 and not logged("external pod vllm-b joined")
            assert not logged("external pod other joined")

            ready = {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}
            await kube.call("PATCH", f"{pods}/vllm-b/status", ready)
            await until_async(lambda: blocks("external-vllm-b", 4), what="b followed once ready (replayed)",
                              timeout=30)  # fmt: skip
            await until_async(lambda: engines(3), what="three engines in the pool", timeout=30)

            await kube.call("DELETE", f"{pods}/vllm-a")
            await until_async(lambda: blocks("external-vllm-a", 0), what="a's index cleared", timeout=30)
            await until_async(lambda: engines(2), what="a's record gone", timeout=30)
            assert logged("external pod vllm-a left the engine pool")
            c.store(1, 400)  # the others are still followed
            await until_async(lambda: blocks("external-vllm-c", 3), what="c still followed", timeout=30)
            assert await state.num_blocks("external-vllm-b") == 4
        finally:
            await router.stop_async()
            await state.close()
            for pub in pubs.values():
                pub.pub.close()
        calls = set(kube.calls)
    assert calls == {("list", "", "pods"), ("watch", "", "pods")}


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_pod_with_a_new_address_is_a_new_engine(model_dir):
    """In process: the watcher's events for one pod whose address changes (here its KV-event ports, as a
    restarted pod's IP would): the old engine's blocks are cleared, the new one followed from cold."""
    from ragserve.router_args import RouterConfig
    from ragserve_router.external import ExternalEngines, load_tokenizer
    from ragserve_router.k8s import ExternalPodWatcher
    from ragserve_router.memory_state import MemoryState
    from ragserve_router.metrics import RouterMetrics
    from ragserve_router.pool import EnginePool

    cfg = RouterConfig(external_k8s_selector="app=vllm", k8s_namespace=NS, tokenizer=str(model_dir))
    external = ExternalEngines([], load_tokenizer(str(model_dir)), cfg.external_block_size)
    state = MemoryState()
    pool = EnginePool(cfg, state, RouterMetrics(), external)
    external.start(state)
    watcher = ExternalPodWatcher(cfg, pool, external)
    old, new = Publisher(), Publisher()
    http = free_port()

    def pod(pub: Publisher) -> dict:
        return vllm_pod("vllm-x", {"http": http, "kv-events": pub.pub_port, "kv-replay": pub.replay_port})

    async def blocks(expected: int) -> bool:
        return await state.num_blocks("external-vllm-x") == expected

    try:
        assert pod_external_spec(pod(old)) != pod_external_spec({**pod(old), "status": {
            **pod(old)["status"], "podIP": "10.0.0.9"}})  # fmt: skip
        watcher.apply("ADDED", pod(old))
        watcher.apply("MODIFIED", pod(old))  # an unchanged pod: nothing restarts
        (first,) = external.followers["external-vllm-x"]
        old.store(3, 100)
        await until_async(lambda: blocks(3), what="the old address's blocks", timeout=20)
        watcher.apply("MODIFIED", pod(new))
        (second,) = external.followers["external-vllm-x"]
        assert second is not first and pool.discovered["external-vllm-x"].url == f"http://127.0.0.1:{http}"
        await until_async(lambda: blocks(0), what="the old engine cleared", timeout=20)
        old.store(2, 200)  # the old address is no longer followed
        new.store(1, 300)
        await until_async(lambda: blocks(1), what="the new address's blocks", timeout=20)
        watcher.apply("MODIFIED", {**pod(new), "status": {"phase": "Running", "podIP": "127.0.0.1"}})  # not ready
        await until_async(lambda: blocks(0), what="not ready: cleared", timeout=20)
        assert "external-vllm-x" not in pool.discovered and "external-vllm-x" not in external.followers
    finally:
        await external.stop()
        await pool.close()
        old.pub.close()
        new.pub.close()


def test_external_k8s_selector_needs_a_tokenizer(model_dir):
    from ragserve.router_args import RouterConfig

    with pytest.raises(ValueError, match="--external-k8s-selector needs --tokenizer"):
        RouterConfig(external_k8s_selector="app=vllm")
    assert RouterConfig(external_k8s_selector="app=vllm", tokenizer=str(model_dir)).external_k8s_selector == "app=vllm"
