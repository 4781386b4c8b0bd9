"""Router test fixtures: real router, `ragserve engine` and redis-server processes on loopback ports.

Routing, shared-state, gateway, SDK and discovery tests run on real engines (the tiny llama model):
`fleet` is one kv_aware router with three registered engines for the whole session (tests use their own
documents, so they do not share cached prefixes); `Cluster.real_engines` starts more. The stand-in
`Cluster.engine` (tests/helpers/fake_engine.py) is only for faults a real engine cannot produce on demand:
5xx answers, held, slow or cut streams. Every process binds 127.0.0.1 on a free port and is stopped by
the fixture that started it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.helpers import process
from tests.helpers.net import free_port

FAKE_ENGINE = Path(__file__).parents[1] / "helpers" / "fake_engine.py"
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Server(process.Proc):
    """A process serving HTTP on `port` (and the router's gRPC registry on `grpc_port`)."""

    port: int = 0
    grpc_port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def grpc(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"


class Cluster:
    """Starts processes and stops them all at teardown."""

    def __init__(self, tmp: Path, model_dir: Path) -> None:
        self.tmp = tmp
        self.model_dir = model_dir
        self.procs: list[process.Proc] = []

    def _spawn(self, name: str, argv: list[str], port: int, grpc_port: int = 0, env: dict | None = None) -> Server:
        log = self.tmp / f"{name}-{len(self.procs)}.log"
        path = os.pathsep.join(filter(None, (os.environ.get("PYTHONPATH"), str(ROOT))))  # a worktree's own packages
        full_env = {**os.environ, "PYTHONPATH": path, **(env or {})}
        proc = process.start(name, argv, log, env=full_env, cwd=self.tmp)
        server = Server(proc.name, proc.popen, proc.log, port, grpc_port)
        self.procs.append(server)
        return server

    def wait_http(self, proc: Server, timeout: float = 60) -> None:
        process.wait_http(proc.url + "/health", proc=proc, timeout=timeout)

    def wait_registered(self, engine: Server, timeout: float = 300) -> None:
        """Until the engine's /ready says the router acknowledged its registration. Fails at once if the engine
        exits; the timeout only bounds a hung start."""

        def registered() -> bool:
            r = httpx.get(engine.url + "/ready", timeout=5)
            return r.status_code == 200 and r.json().get("registered") is True

        what = f"{engine.name} registered with the router"
        process.until(registered, timeout=timeout, interval=0.05, what=what, proc=engine)

    def router(self, *flags: str, env: dict | None = None, wait: bool = True, name: str = "router") -> Server:
        port, grpc_port = free_port(), free_port()
        argv = [sys.executable, "-m", "ragserve.cli", "router", "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--grpc-port", str(grpc_port), *flags]
        if not {"--registry-token-file", "--tls-client-ca"} & set(flags):  # registry auth: see test_registry
            argv.append("--registry-allow-unauthenticated")  # the stand-in engines register without a token
        proc = self._spawn(name, argv, port, grpc_port, env)
        if wait:
            self.wait_http(proc)
        return proc

    def engine(self, engine_id: str, *flags: str, router: Server | None = None, port: int | None = None) -> Server:
        """The fault-injection stand-in (--fail-status, /control/hold); not for routing outcomes."""
        port = port or free_port()
        argv = [sys.executable, str(FAKE_ENGINE), "--port", str(port), "--engine-id", engine_id]
        argv += ["--model-dir", str(self.model_dir), *flags]
        if router is not None:
            argv += ["--router", router.grpc]
        proc = self._spawn(engine_id, argv, port)
        self.wait_http(proc)
        return proc

    def real_engines(
        self,
        router: Server | None,
        count: int,
        *flags: str,
        ports: list[int] | None = None,
        ids: list[str] = (),
        wait: bool = True,
        launcher: tuple[str, ...] = ("-m", "ragserve.cli"),
    ) -> list[Server]:
        """Real `ragserve engine` processes on the tiny test model, registered with the router (if any).
        `launcher`: python's arguments before `engine` (`-c` and a script that injects a fault, then runs the CLI)."""
        procs = []
        for i in range(count):
            port = ports[i] if ports else free_port()
            argv = [sys.executable, *launcher, "engine", "--host", "127.0.0.1", "--port", str(port)]
            argv += ["--model", str(self.model_dir), "--served-model-name", "tiny", "--device", "cpu"]
            if router is not None:
                argv += ["--router", router.grpc, "--advertise-url", f"http://127.0.0.1:{port}"]
            argv += ["--engine-id", ids[i]] if ids else []
            procs.append(self._spawn(ids[i] if ids else f"engine-{port}", [*argv, *flags], port))
        for proc in procs if wait else ():
            self.wait_http(proc, timeout=300)
        return procs

    def redis(self) -> str:
        proc, url = process.start_redis(self.tmp)
        self.procs.append(proc)
        return url

    def stop_all(self) -> None:
        """The engines (real and stand-in) first, all signalled at once (each drains on its own, while the routers
        still answer their deregistration), then the rest one by one, the last started first."""
        procs = list(reversed(self.procs))
        engines = [p for p in procs if "engine" in p.popen.args or str(FAKE_ENGINE) in p.popen.args]
        signalled = {id(p) for p in engines}
        for proc in engines:
            proc.terminate()
        for proc in engines:
            proc.reap()
        for proc in procs:
            if id(proc) not in signalled:
                proc.stop()


@contextlib.contextmanager
def running(engine: Server) -> Iterator[None]:
    """A request of the engine's own streams for the block: an engine SIGTERMed meanwhile drains and stays up for it,
    answering every new request 503 (`draining`), a real engine's 5xx; it exits once the block is left."""
    body = {"model": "tiny", "prompt": "Count:", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", engine.url + "/v1/completions", json=body, timeout=300) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()  # held: a generator dropped closes the connection (the engine aborts the request)
        next(lines)  # running
        yield


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from tests.helpers.tiny_models import tiny_model

    return tiny_model("llama")


@pytest.fixture
def cluster(tmp_path, model_dir):
    c = Cluster(tmp_path, model_dir)
    yield c
    c.stop_all()


@pytest.fixture(scope="module")
def module_cluster(tmp_path_factory, model_dir):
    c = Cluster(tmp_path_factory.mktemp("cluster"), model_dir)
    yield c
    c.stop_all()


@dataclass
class Fleet:
    """A kv_aware router (policy header allowed) and the real engines registered with it."""

    cluster: Cluster
    router: Server
    engines: list[Server]


def case_file(i: int) -> str:
    """~1,900 tokens of unique text: a prompt whose prefill, not its decode, is the work (routing tests)."""
    return f"Case file {i}: " + " ".join(f"item {i}-{j} weighs {j * 13 % 97} grams." for j in range(150))


def decisions(metrics, url: str) -> float:
    """The router's routing decisions so far, all policies and reasons."""
    return sum(v for (name, _), v in metrics.scrape(url).items() if name == "ragserve_router_routing_decisions_total")


def measure_prefill(router: Server, engines: list[Server], prompt: Callable[[int], str], times: int = 3) -> None:
    """Before any other traffic, give each engine in turn `times` fresh prompts like the test's own, straight to the
    engine, so the prefill rate each reports is measured on the same work on an otherwise idle machine instead of by
    start-up calibration's short prompts while its peers load (15k to 43k tokens/s seen on one machine for one
    model); then wait until the router holds a heartbeat carrying all of it (its per-engine computed-token gauge)."""
    for engine in engines:
        computed = 0
        for k in range(times):
            messages = [{"role": "user", "content": prompt(k)}]
            body = {"model": "tiny", "messages": messages, "max_tokens": 1, "cache_salt": engine.name}
            resp = httpx.post(engine.url + "/v1/chat/completions", json=body, timeout=120)
            assert resp.status_code == 200, resp.text
            usage = resp.json()["usage"]
            computed += usage["prompt_tokens"] - (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        key = ("ragserve_router_engine_prompt_tokens", (("engine", engine.name), ("source", "computed")))
        seen = functools.partial(lambda key, n: scrape(router.url).get(key, 0) >= n, key, computed)
        process.until(seen, timeout=30, what=f"{engine.name}'s measured prefill in the router")


def registered(router: Server) -> int:
    return httpx.get(router.url + "/ready", timeout=5).json()["engines"]


@pytest.fixture(scope="session")
def fleet(tmp_path_factory, model_dir):
    c = Cluster(tmp_path_factory.mktemp("fleet"), model_dir)
    router = c.router("--heartbeat-interval-ms", "300", "--allow-policy-header", name="fleet-router")
    engines = c.real_engines(router, 3, "--num-gpu-blocks", "1024", "--max-model-len", "4096",
                             ids=[f"fleet-{i}" for i in range(3)])  # fmt: skip
    for engine in engines:
        c.wait_registered(engine)
    assert registered(router) == 3
    yield Fleet(c, router, engines)
    c.stop_all()


@pytest.fixture
def until():
    """Poll a predicate until truthy (returns its value); fails the test after `timeout`."""

    def wait(predicate, timeout: float = 20, interval: float = 0.05, message: str = "condition"):
        return process.until(predicate, timeout=timeout, interval=interval, what=message)

    return wait


@pytest.fixture(scope="session")
def prompt_tokenizer(model_dir):
    from ragserve.tokenizer import PromptTokenizer

    return PromptTokenizer.from_dir(model_dir)


@pytest.fixture(scope="session")
def make_register(prompt_tokenizer):
    """Build a RegisterRequest the way a correct engine does; keyword overrides break it on purpose."""
    import json

    from ragserve.keys import KEY_SCHEME, probe_hashes
    from ragserve.v1 import registry_pb2

    def make(engine_id: str, model: str = "tiny", model_id: str = "tiny@test", block_size: int = 16, **over):
        tok = prompt_tokenizer
        identity = dict(
            engine_id=engine_id,
            url=over.pop("url", "http://127.0.0.1:9"),
            served_model_name=model,
            model_id=model_id,
            key_scheme=over.pop("key_scheme", KEY_SCHEME),
            block_size=block_size,
            tokenizer_fingerprint=over.pop("tokenizer_fingerprint", tok.fingerprint()),
        )
        probes = over.pop("probe_block_hashes", None)
        if probes is None:
            probes = probe_hashes(tok, block_size, model_id) if block_size else []
        return registry_pb2.RegisterRequest(
            identity=registry_pb2.EngineIdentity(**identity),
            tokenizer_json=over.pop("tokenizer_json", tok.tokenizer_json.encode()),
            chat_template=tok.chat_template or "",
            special_tokens_json=json.dumps(tok.special_tokens),
            num_blocks=1000,
            probe_block_hashes=probes,
            **over,
        )

    return make


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """The router's /metrics parsed with prometheus_client: {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=5).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.fixture
def metrics():
    def value(url: str, name: str, **labels) -> float:
        return scrape(url).get((name, tuple(sorted(labels.items()))), 0.0)

    def total(url: str, name: str) -> float:
        return sum(v for (n, _), v in scrape(url).items() if n == name)

    value.scrape = scrape
    value.total = total
    return value
