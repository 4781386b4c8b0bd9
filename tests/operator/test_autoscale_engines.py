"""Autoscaling against real `ragserve engine` processes (tiny model): load generated here makes requests
queue, the operator scales the pool up to maxReplicas, holds through the stabilization window once the
load stops, then scales down to minReplicas."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from ragserve.stack import health
from ragserve_operator.spec import GROUP, PLURAL, VERSION
from tests.helpers.process import Proc, start, until_async
from tests.helpers.ragserve_cr import BASE, NS, operator_autoscaled, ragserve
from tests.helpers.tiny_models import tiny_model

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(420)]
DEPLOYMENT = "scale-engine-a"


def start_engine(port: int, log: Path, *flags: str) -> Proc:
    argv = [sys.executable, "-m", "ragserve.cli", "engine", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--model", str(tiny_model("llama")), "--served-model-name", "tiny", "--device", "cpu"]
    argv += ["--max-num-seqs", "1", *flags]  # one running request per engine: the rest queue
    return start("engine", argv, log)


async def wait_healthy(proc: Proc, port: int, timeout: float = 300.0) -> None:
    async def healthy() -> bool:
        assert proc.alive(), proc.failure("engine exited")
        return await asyncio.to_thread(health.check, f"http://127.0.0.1:{port}/health")

    await until_async(healthy, timeout=timeout, interval=0.5, what=f"engine on {port} healthy")


STORY = {"model": "tiny", "prompt": "Tell me a long story about caches.", "max_tokens": 256, "ignore_eos": True}


async def keep_busy(port: int, stop: asyncio.Event, body_of: Callable[[int], dict] = lambda _: STORY) -> int:
    """One client slot: completions (the i-th one's body: body_of(i)) back to back until told to stop. Returns
    completions done."""
    done = 0
    async with httpx.AsyncClient(timeout=120.0) as client:
        while not stop.is_set():
            response = await client.post(f"http://127.0.0.1:{port}/v1/completions", json=body_of(done))
            assert response.status_code == 200, response.text
            done += 1
    return done


# an hour-long scale-down window: once the load stops the operator must hold 3 replicas however slow the
# machine is; the test then shortens it to 0 and the scale-down follows
SPEC = operator_autoscaled("tiny", scale_down_stabilization_s=3600)


async def test_scales_real_engines(kube, operator, eventually, free_ports, engine_pod, tmp_path):
    ports = free_ports(2)
    engines = [start_engine(p, tmp_path / f"engine-{p}.log") for p in ports]
    stop = asyncio.Event()
    try:
        await asyncio.gather(*(wait_healthy(e, p) for e, p in zip(engines, ports, strict=True)))
        await kube.call("POST", BASE, ragserve("scale", SPEC))
        for i, port in enumerate(ports):
            await kube.call("POST", f"/api/v1/namespaces/{NS}/pods", engine_pod(f"scale-a-{i}", "a", "scale", port))

        def replicas() -> int | None:
            live = kube.obj("apps/v1/deployments", DEPLOYMENT)
            return None if live is None else live["spec"]["replicas"]

        def record() -> dict:
            status = (kube.obj(f"{GROUP}/{VERSION}/{PLURAL}", "scale") or {}).get("status") or {}
            return (status.get("autoscaling") or [{}])[0]

        await eventually(lambda: record().get("podsWithMetrics") == 2, what="both engines scraped", timeout=60)
        assert replicas() == 1 and record()["metrics"]["waiting"] == 0  # idle: stays at minReplicas

        slots = [asyncio.create_task(keep_busy(p, stop)) for p in ports for _ in range(6)]
        await eventually(lambda: replicas() == 3, what="scale up under queueing", timeout=120)

        def scaled_up() -> bool:
            return any(e["reason"] == "Scaled" and "-> 3 replicas (waiting" in e["message"] for e in kube.events())

        await eventually(scaled_up, what="the Scaled event")

        await eventually(lambda: record().get("desiredReplicas") == 3, what="the scale-up recorded")
        scaled_up_at = record()["lastScaleTime"]
        stop.set()  # in-flight requests drain; the recommendation drops, the window holds 3
        finished = await asyncio.gather(*slots)
        assert sum(finished) >= len(slots)

        def held() -> bool:
            r = record()
            return r["metrics"]["waiting"] == 0 and r["recommendedReplicas"] < 3 and "window keeps 3" in r["reason"]

        await eventually(held, what="idle engines, 3 replicas held by the window", timeout=60)
        assert record()["desiredReplicas"] == 3 and record()["lastScaleTime"] == scaled_up_at
        assert replicas() == 3

        await kube.call("PATCH", f"{BASE}/scale", {"spec": {"autoscaling": {"scaleDownStabilizationSeconds": 0}}})
        await eventually(lambda: replicas() == 1, what="scale down once the window is 0", timeout=90)
        await eventually(lambda: record().get("lastScaleTime") != scaled_up_at, what="the scale-down recorded")
        assert record()["metrics"]["waiting"] == 0 and "stabilization window" not in record()["reason"]
    finally:
        stop.set()
        for engine in engines:
            await engine.stop_async(timeout=30)
    history = [v["spec"]["replicas"] for v in kube.objects["apps/v1/deployments", NS, DEPLOYMENT].history if v]
    # 1, up to 3, held at 3 until the window was shortened, then down to 1: one rise and one fall
    changes = [r for i, r in enumerate(history) if i == 0 or history[i - 1] != r]
    top = changes.index(3)
    assert changes[0] == 1 and changes[-1] == 1 and set(changes) <= {1, 2, 3}
    assert changes[: top + 1] == sorted(changes[: top + 1]) and changes[top:] == sorted(changes[top:], reverse=True)


# Two pools of the same real engines under the same load, one marked prefill and one decode: each scales on its
# role's signals (ragserve.metric_names.load_metrics). The waiting-requests target is out of reach, so only the
# queued prompt tokens (prefill) or KV usage (decode) can move them.
PD_SPEC = {
    "engines": [
        {"name": "p", "model": "tiny", "role": "prefill", "minReplicas": 1, "maxReplicas": 3},
        {"name": "d", "model": "tiny", "role": "decode", "minReplicas": 1, "maxReplicas": 3},
    ],
    "autoscaling": {
        "mode": "operator",
        "intervalSeconds": 1,
        "targetWaitingRequests": 1000,
        "targetQueuedPrefillTokens": 300,
        "targetKVCacheUsage": 0.8,
        "scaleDownStabilizationSeconds": 3600,
    },
}


def long_prompt(slot: int) -> Callable[[int], dict]:
    """~550-token prompts, one token each: prefill work only, queued behind one another (--max-num-seqs 1); each
    its own text from the first token on (a prefix-cache hit is no queued work)."""

    def body(i: int) -> dict:
        text = f"slot {slot} request {i}: " + " ".join(f"passage{j} says {j % 7}." for j in range(75))
        return {"model": "tiny", "prompt": text, "max_tokens": 1}

    return body


async def test_prefill_and_decode_pools_scale_on_their_own_signals(kube, operator, eventually, free_ports, engine_pod,
                                                                   tmp_path):  # fmt: skip
    ports = dict(zip("pd", free_ports(2), strict=True))
    flags = ("--max-num-batched-tokens", "128", "--max-model-len", "1024")  # a prompt takes several steps
    engines = {n: start_engine(port, tmp_path / f"engine-{n}.log", *flags) for n, port in ports.items()}
    stop = asyncio.Event()
    try:
        await asyncio.gather(*(wait_healthy(engines[n], ports[n]) for n in ports))
        await kube.call("POST", BASE, ragserve("pd", PD_SPEC))
        for n, port in ports.items():
            await kube.call("POST", f"/api/v1/namespaces/{NS}/pods", engine_pod(f"pd-{n}-0", n, "pd", port))

        def records() -> dict[str, dict]:
            status = (kube.obj(f"{GROUP}/{VERSION}/{PLURAL}", "pd") or {}).get("status") or {}
            return {r["pool"]: r for r in status.get("autoscaling") or []}

        def replicas(pool: str) -> int | None:
            live = kube.obj("apps/v1/deployments", f"pd-engine-{pool}")
            return None if live is None else live["spec"]["replicas"]

        scraped = lambda: {p: r.get("podsWithMetrics") for p, r in records().items()} == {"p": 1, "d": 1}  # noqa: E731
        await eventually(scraped, what="both scraped")  # both pools: the status may name one of them first
        assert set(records()["p"]["metrics"]) == {"waiting", "queued_prefill_tokens"}
        assert set(records()["d"]["metrics"]) == {"waiting", "kv_usage"}
        slots = [
            asyncio.create_task(keep_busy(port, stop, long_prompt(k))) for port in ports.values() for k in range(6)
        ]
        await eventually(
            lambda: replicas("p") == 3, what="the prefill pool scaled on queued prompt tokens", timeout=120
        )
        stop.set()
        assert sum(await asyncio.gather(*slots)) >= len(slots)
        scaled = [e["message"] for e in kube.events() if e["reason"] == "Scaled"]
        assert scaled and all(m.startswith("engine pool p: ") and "(queued_prefill_tokens " in m for m in scaled)
        assert replicas("d") == 1  # the same load: no decode signal moved
    finally:
        stop.set()
        for engine in engines.values():
            await engine.stop_async(timeout=30)
