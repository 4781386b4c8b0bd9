"""Helpers for the engine-server tests: a real `ragserve engine` process on a loopback port.

No tests here; the test_server*/test_registration* modules import it.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.net import free_port
from tests.helpers.process import Proc, start, wait_http

MODEL_NAME = "tiny-llama"


@dataclass
class EngineProc(Proc):
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 120) -> None:
        wait_http(self.url + "/ready", proc=self, timeout=timeout)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        return super().stop(sig, timeout)


def start_engine(tmp: Path, *args: str, port: int | None = None, env: dict | None = None) -> EngineProc:
    """`ragserve engine --model <tiny llama>` on 127.0.0.1; call wait_ready() and stop()."""
    from tests.helpers.tiny_models import tiny_model

    port = port or free_port()
    argv = [sys.executable, "-m", "ragserve.cli", "engine", "--model", str(tiny_model("llama"))]
    argv += ["--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port), *args]
    proc = start("engine", argv, tmp / f"engine-{port}.log", env={**os.environ, **(env or {})})
    return EngineProc(proc.name, proc.popen, proc.log, port)


@contextmanager
def running_engine(tmp: Path, *args: str) -> Iterator[EngineProc]:
    """A ready engine for a module's tests; afterwards it must drain and exit 0 (else the log's tail is shown)."""
    proc = start_engine(tmp, *args)
    try:
        proc.wait_ready()
        yield proc
    finally:
        assert proc.stop() == 0, proc.output()[-3000:]


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


LONG_CONTEXT = (
    "Retrieved passage: PagedAttention divides each sequence's key-value cache into fixed-size blocks that "
    "need not be contiguous in memory. A block table maps logical blocks to physical ones, so memory is "
    "allocated on demand and freed without fragmentation. Prefix caching keys every full block by a chained "
    "hash of its tokens and all earlier tokens, so requests that share a long retrieved context reuse the "
    "blocks another request already computed instead of prefilling them again. "
) * 3
