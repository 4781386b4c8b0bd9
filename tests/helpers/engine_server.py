"""Helpers for the engine-server tests: a real `ragserve engine` process on a loopback port.

No tests here; the test_server*/test_registration* modules import it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.net import free_port

MODEL_NAME = "tiny-llama"


@dataclass
class EngineProc:
    popen: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"engine exited with {self.popen.returncode}:\n{self.output()[-3000:]}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"engine not ready after {timeout}s:\n{self.output()[-3000:]}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.alive():
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        return self.popen.returncode


def start_engine(tmp: Path, *args: str, port: int | None = None, env: dict | None = None) -> EngineProc:
    """`ragserve engine --model <tiny llama>` on 127.0.0.1; call wait_ready() and stop()."""
    from tests.helpers.tiny_models import tiny_model

    port = port or free_port()
    log = tmp / f"engine-{port}.log"
    argv = [sys.executable, "-m", "ragserve.cli", "engine", "--model", str(tiny_model("llama"))]
    argv += ["--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port), *args]
    with log.open("wb") as out:
        popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    return EngineProc(popen, port, log)


def scrape(url: str) -> dict[str, float]:
    """/metrics as {'name{label=value,...}': value}, parsed with prometheus_client's parser."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    key = f"{name}{{{','.join(f'{k}={v}' for k, v in sorted({'model_name': MODEL_NAME, **labels}.items()))}}}"
    return samples[key]


def wait_for(predicate, timeout: float = 30, interval: float = 0.1, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out waiting for {what}")


LONG_CONTEXT = (
    "Retrieved passage: PagedAttention divides each sequence's key-value cache into fixed-size blocks that "
    "need not be contiguous in memory. A block table maps logical blocks to physical ones, so memory is "
    "allocated on demand and freed without fragmentation. Prefix caching keys every full block by a chained "
    "hash of its tokens and all earlier tokens, so requests that share a long retrieved context reuse the "
    "blocks another request already computed instead of prefilling them again. "
) * 3
