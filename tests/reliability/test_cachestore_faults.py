"""The shared KV-block store is an accelerator, never a source of wrong answers or failures: a SIGKILLed
cachestore costs only misses, and corrupted disk blocks are never served (outputs equal a cold engine's)."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.cachestore import CacheStoreProcess
from tests.helpers.engine_server import start_engine
from tests.helpers.net import free_port
from tests.helpers.process import until
from tests.reliability.conftest import under_load

PROMPTS = [[1000 + 97 * k + j for j in range(16 * 10 + 3)] for k in range(3)]  # 10 full blocks each


def complete(url: str, ids: list[int]) -> list[int]:
    body = {"prompt": ids, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    resp = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["token_ids"]


def store_metric(url: str, name: str, **labels: str) -> float:
    families = text_string_to_metric_families(httpx.get(url + "/metrics", timeout=5).text)
    return sum(s.value for f in families for s in f.samples if s.name == name and labels.items() <= s.labels.items())


def corrupt(directory: Path) -> int:
    """Flip bytes near the end of every file (the block payload); returns how many files were damaged."""
    damaged = 0
    for path in (p for p in directory.rglob("*") if p.is_file() and p.stat().st_size > 64):
        data = bytearray(path.read_bytes())
        for i in range(len(data) - 40, len(data) - 8):
            data[i] ^= 0x5A
        path.write_bytes(bytes(data))
        damaged += 1
    return damaged


def test_corrupted_disk_blocks_are_never_served(tmp_path):
    disk, metrics_port = tmp_path / "disk", free_port()
    args = ["--memory", "48KiB", "--disk-dir", str(disk), "--disk", "64MiB", "--metrics-port", str(metrics_port)]
    store = CacheStoreProcess(tmp_path / "cachestore.log", free_port(), *args).wait_serving()
    store_url = f"http://127.0.0.1:{metrics_port}"
    engines = [start_engine(tmp_path, "--num-gpu-blocks", "128", "--cachestore", store.address) for _ in range(2)]
    try:
        for proc in engines:
            proc.wait_ready()
        cold, warm = engines
        reference = [complete(cold.url, ids) for ids in PROMPTS]  # computed from scratch: nothing was stored yet
        until(lambda: store_metric(store_url, "ragserve_cachestore_puts_total") >= 30, what="blocks offloaded")
        assert corrupt(disk) >= 10  # RAM holds a few blocks; the rest went to disk
        assert [complete(warm.url, ids) for ids in PROMPTS] == reference
        assert store_metric(store_url, "ragserve_cachestore_corrupt_total", tier="disk") > 0
        assert httpx.get(warm.url + "/ready").status_code == 200
    finally:
        for proc in engines:
            proc.stop()
        store.stop()


def test_a_sigkilled_cachestore_costs_only_misses(tmp_path):
    store = CacheStoreProcess(tmp_path / "cachestore.log", free_port(), "--memory", "64MiB").wait_serving()
    engine = start_engine(tmp_path, "--num-gpu-blocks", "256", "--cachestore", store.address)
    try:
        engine.wait_ready()
        reference = [complete(engine.url, ids) for ids in PROMPTS]

        def call(i: int, n: int) -> list[int]:
            if n % 2 == 0:
                return complete(engine.url, PROMPTS[(i + n) % len(PROMPTS)])
            return complete(engine.url, [7, i, n, *PROMPTS[i][3:]])  # new blocks to offload

        answers = under_load(call, 3, lambda: store.stop(signal.SIGKILL), warmup=6, after=12)
        assert len(answers) >= 12
        assert [complete(engine.url, ids) for ids in PROMPTS] == reference
        assert httpx.get(engine.url + "/ready").status_code == 200
    finally:
        engine.stop()
        store.stop()
