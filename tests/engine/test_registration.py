"""Registration, heartbeats and KV events against the real router (`ragserve router` processes sharing a real
redis-server): every assertion is on the router's view of the engine, its registry record and KV index as it
keeps them in Redis (redis_state.py's keys), its /ready and /metrics."""

from __future__ import annotations

import json
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
import redis

from ragserve import __version__
from ragserve.keys import KEY_SCHEME, probe_hashes
from ragserve.model_source import model_fingerprint, resolve_model
from ragserve.tokenizer import PromptTokenizer
from ragserve.v1 import registry_pb2, registry_pb2_grpc
from ragserve_router.cost_model import calibrate
from ragserve_router.engines import EngineRecord
from tests.helpers import process
from tests.helpers.engine_server import MODEL_NAME, metric, scrape, start_engine
from tests.helpers.net import free_port
from tests.helpers.pki import write_test_pki
from tests.helpers.process import until
from tests.helpers.registration import complete, expected_index, prompt_ids
from tests.helpers.tiny_models import tiny_model

HEARTBEAT_MS = 200
PREFIX = "reg:"


@dataclass
class Router:
    proc: process.Proc
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the router's `name` samples carrying `labels`."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.url + "/metrics", timeout=5).text
        samples = (s for family in text_string_to_metric_families(text) for s in family.samples)
        return sum(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())

    def engines(self) -> int:
        return httpx.get(self.url + "/ready", timeout=5).json()["engines"]


class Stack:
    """A redis-server, `ragserve router` processes on one fixed gRPC port (a restart keeps the engine's address)
    and engines registered with it; the router's registry read back from Redis."""

    def __init__(self, tmp: Path) -> None:
        self.tmp, self.grpc_port = tmp, free_port()
        self.redis_proc, self.redis_url = process.start_redis(tmp)
        self.redis = redis.Redis.from_url(self.redis_url)
        self.routers: list[Router] = []
        self.engines: list = []

    def router(self, *flags: str, heartbeat_ms: int = HEARTBEAT_MS) -> Router:
        port = free_port()
        argv = [sys.executable, "-m", "ragserve.cli", "router", "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--grpc-port", str(self.grpc_port), "--redis", self.redis_url, "--redis-prefix", PREFIX]
        argv += ["--heartbeat-interval-ms", str(heartbeat_ms), *flags]
        if "--tls-client-ca" not in flags:
            argv.append("--registry-allow-unauthenticated")
        proc = process.start("router", argv, self.tmp / f"router-{len(self.routers)}.log")
        router = Router(proc, port)
        self.routers.append(router)
        process.wait_http(router.url + "/health", proc=proc, timeout=60)
        return router

    def engine(self, engine_id: str, *args: str, wait: bool = True):
        proc = start_engine(self.tmp, "--num-gpu-blocks", "256", "--router", f"127.0.0.1:{self.grpc_port}",
                            "--engine-id", engine_id, *args)  # fmt: skip
        self.engines.append(proc)
        proc.wait_ready()
        if wait:
            wait_registered(proc)
        return proc

    # -- the router's registry, as it keeps it in Redis ------------------------------------------------------

    def record(self, engine_id: str) -> EngineRecord | None:
        raw = self.redis.hget(PREFIX + "engines", engine_id)
        return EngineRecord.from_json(raw) if raw is not None else None

    def index(self, engine_id: str) -> set[bytes]:
        return set(self.redis.smembers(f"{PREFIX}blocks:{engine_id}"))

    def seq(self, engine_id: str) -> int:
        return int(self.redis.get(f"{PREFIX}seq:{engine_id}") or 0)

    def stop(self) -> None:
        for proc in self.engines:
            proc.stop(signal.SIGKILL)
        for router in self.routers:
            router.proc.stop()
        self.redis.close()
        self.redis_proc.stop()


def wait_registered(engine, timeout: float = 300) -> None:
    """Until the engine's /ready says the router acknowledged its registration; fails at once if it exits."""

    def registered() -> bool:
        r = httpx.get(engine.url + "/ready", timeout=5)
        return r.status_code == 200 and r.json().get("registered") is True

    until(registered, timeout=timeout, interval=0.05, what=f"{engine.name} registered", proc=engine)


@pytest.fixture
def stack(tmp_path):
    s = Stack(tmp_path)
    yield s
    s.stop()


def test_register_request_carries_the_engine_identity(stack):
    router = stack.router()
    proc = stack.engine("eng-id", "--advertise-url", "http://10.1.2.3:8000/", "--cachestore", "127.0.0.1:1")
    record = stack.record("eng-id")
    path = tiny_model("llama")
    model_id = model_fingerprint(resolve_model(str(path), MODEL_NAME))
    tok = PromptTokenizer.from_dir(path)
    assert (record.engine_id, record.url, record.models) == ("eng-id", "http://10.1.2.3:8000", [MODEL_NAME])
    assert (record.model_id, record.block_size, record.version) == (model_id, 16, __version__)
    assert record.tokenizer_fingerprint == tok.fingerprint() and len(record.layout_fingerprint) == 32
    assert record.cachestore == "127.0.0.1:1"  # identity; heartbeats' Load no longer carries it
    assert "cachestore" not in registry_pb2.Load.DESCRIPTOR.fields_by_name
    assert (record.num_blocks, record.max_model_len) == (256, 4096)
    # the router rebuilt the tokenizer from what the engine shipped and found the same fingerprint and probe
    # hashes (it refuses otherwise): nothing refused, one registration, the model listed
    shipped = json.loads(stack.redis.get(f"{PREFIX}tok:{tok.fingerprint()}"))
    assert shipped["tokenizer_json"] == tok.tokenizer_json and shipped["chat_template"] == tok.chat_template
    assert router.metric("ragserve_router_registrations_total") == 1
    assert router.metric("ragserve_router_registrations_refused_total") == 0
    assert [m["id"] for m in httpx.get(router.url + "/v1/models").json()["data"]] == [MODEL_NAME]
    assert httpx.get(proc.url + "/ready").json()["registered"] is True


def test_heartbeats_report_load_and_events_build_the_index(stack):
    router = stack.router()
    proc = stack.engine("eng-hb")
    first = stack.record("eng-hb").load.reported_at
    until(lambda: stack.record("eng-hb").load.reported_at > first, what="a heartbeat after the registration")
    load = stack.record("eng-hb").load
    assert load.total_blocks == 256 and load.free_blocks == 256
    prompts = [prompt_ids(k) for k in range(3)]
    for ids in prompts:
        complete(proc.url, ids)
    want = expected_index(stack.record("eng-hb").model_id, prompts)
    until(lambda: stack.index("eng-hb") == want, what="the router's index equal to the engine's cached blocks")
    # first contact: a (here empty) snapshot, then each prompt's blocks as one chain event, numbered from 1
    kinds = {k: router.metric("ragserve_router_kv_events_total", kind=k) for k in ("cleared", "stored", "removed")}
    assert kinds == {"cleared": 1, "stored": 3, "removed": 0} and stack.seq("eng-hb") == 4


def test_first_heartbeat_carries_start_up_measurements_and_no_calibration_trace(stack):
    """The engine calibrates before it reports ready: the router has a measured prefill rate and decode line,
    its per-sequence slope included, from the first heartbeat on, the per-step prefill cap, and nothing of the
    synthetic requests in its KV index, nor in the engine's counters or request metrics."""
    router = stack.router()
    proc = stack.engine("eng-cal", "--long-prefill-token-threshold", "64", "--max-long-partial-prefills", "2")
    until(lambda: stack.record("eng-cal").load.reported_at > 0, what="the first heartbeat")
    load = stack.record("eng-cal").load
    assert load.prefill_tokens_per_s > 0 and load.long_prefill_token_threshold == 64
    assert load.max_long_partial_prefills == 2
    assert (load.computed_prompt_tokens, load.queued_prefill_tokens, load.free_blocks) == (0, 0, 256)
    # calibration decoded at batch 3 and 1: the slope was fitted, and the router ranks the engine on it
    assert load.decode_step_s > 0 and load.decode_seq_measured, load
    assert load.decode_path in (registry_pb2.DECODE_EAGER, registry_pb2.DECODE_EAGER_BEFORE_GRAPHS)
    assert calibrate(load, [], 16).seq_s == load.decode_seq_s
    # one empty snapshot: no salted blocks (it travels on the KV-event stream, not with the heartbeat: wait for it)
    until(lambda: stack.seq("eng-cal") >= 1, what="the registration snapshot")
    assert stack.index("eng-cal") == set() and stack.seq("eng-cal") == 1
    assert router.metric("ragserve_router_kv_events_total", kind="stored") == 0
    samples = scrape(proc.url)
    assert metric(samples, "ragserve:prefill_tokens_per_second") > 0
    assert metric(samples, "vllm:prefix_cache_queries_total") == 0
    assert not any(k.startswith(("vllm:request_success_total", "vllm:prompt_tokens_total")) and v
                   for k, v in samples.items())  # fmt: skip


@pytest.mark.parametrize("router_kept_state", [False, True], ids=["router-lost-state", "router-kept-state"])
def test_reconnect_resyncs_the_index(stack, router_kept_state):
    # heartbeats 20 s apart: the engine's record outlives the restart (3 missed heartbeats), so a router that
    # kept Redis still knows it and its seq when it registers again
    router = stack.router(heartbeat_ms=20_000)
    proc = stack.engine("eng-rc")
    complete(proc.url, prompt_ids(0))
    model_id = stack.record("eng-rc").model_id
    until(lambda: stack.index("eng-rc") == expected_index(model_id, [prompt_ids(0)]), what="first events")
    before = stack.seq("eng-rc")
    router.proc.stop()
    complete(proc.url, prompt_ids(1))  # the engine keeps serving while the router is away
    complete(proc.url, prompt_ids(2))
    if not router_kept_state:
        stack.redis.flushdb()
    router = stack.router(heartbeat_ms=20_000)
    until(lambda: router.metric("ragserve_router_registrations_total") >= 1, timeout=60, what="re-registration")
    want = expected_index(model_id, [prompt_ids(k) for k in range(3)])
    until(lambda: stack.index("eng-rc") == want, what="the router's index resynced after the reconnect")
    cleared = router.metric("ragserve_router_kv_events_total", kind="cleared")
    stored = router.metric("ragserve_router_kv_events_total", kind="stored")
    if router_kept_state:  # replay: the two prompts' events missed while away, numbered on from the old seq
        assert (cleared, stored, stack.seq("eng-rc")) == (0, 2, before + 2)
    else:  # snapshot: cleared + every cached hash, numbered from 1
        assert cleared == 1 and stored >= 1 and stack.seq("eng-rc") == 1 + stored
    assert proc.alive()


def test_unknown_engine_registers_again(stack):
    """An engine that missed its heartbeats is dropped with its index; when it is back, the router's
    known=false makes it register again and send a snapshot."""
    router = stack.router()
    proc = stack.engine("eng-fg")
    complete(proc.url, prompt_ids(5))
    want = expected_index(stack.record("eng-fg").model_id, [prompt_ids(5)])
    until(lambda: stack.index("eng-fg") == want, what="events")
    proc.popen.send_signal(signal.SIGSTOP)
    try:
        until(lambda: stack.record("eng-fg") is None, timeout=60, what="the router dropping a silent engine")
        assert stack.index("eng-fg") == set() and router.engines() == 0
        assert router.metric("ragserve_router_engines_dropped_total", reason="heartbeat_timeout") == 1
    finally:
        proc.popen.send_signal(signal.SIGCONT)
    until(lambda: router.metric("ragserve_router_registrations_total") == 2, what="re-registration on known=false")
    until(lambda: stack.index("eng-fg") == want, what="snapshot after the router forgot the engine")
    assert router.engines() == 1


def test_refused_engine_keeps_serving_and_retries(stack):
    """A live engine serving the model under another model_id makes the router refuse this one (model_conflict);
    it serves meanwhile, says so loudly once, and is admitted on a retry once the conflicting engine is gone."""
    router = stack.router()
    tok = PromptTokenizer.from_dir(tiny_model("llama"))
    other = registry_pb2.RegisterRequest(
        identity=registry_pb2.EngineIdentity(
            engine_id="conflicting", url="http://127.0.0.1:9", served_model_name=MODEL_NAME, model_id="other@1",
            key_scheme=KEY_SCHEME, block_size=16, tokenizer_fingerprint=tok.fingerprint(),
        ),
        tokenizer_json=tok.tokenizer_json.encode(), chat_template=tok.chat_template or "",
        special_tokens_json=json.dumps(tok.special_tokens), num_blocks=100,
        probe_block_hashes=probe_hashes(tok, 16, "other@1"),
    )  # fmt: skip
    gone = threading.Event()
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
        stub = registry_pb2_grpc.RegistryStub(channel)
        stub.Register(other, timeout=10)

        def keep_alive() -> None:  # the conflicting engine's heartbeats, until the test lets it go
            while not gone.wait(HEARTBEAT_MS / 2000):
                stub.Heartbeat(registry_pb2.HeartbeatRequest(engine_id="conflicting"), timeout=10)

        beats = threading.Thread(target=keep_alive, daemon=True)
        beats.start()
        try:
            proc = stack.engine("eng-refused", wait=False)
            refused = "ragserve_router_registrations_refused_total"
            until(lambda: router.metric(refused, reason="model_conflict") >= 2, timeout=60, what="refusals")
            assert complete(proc.url, prompt_ids(7))["usage"]["completion_tokens"] == 1
            assert httpx.get(proc.url + "/ready").json().get("registered") is False
        finally:
            gone.set()
            beats.join()
    until(lambda: stack.record("conflicting") is None, timeout=30, what="the conflicting engine dropped")
    wait_registered(proc, timeout=60)
    assert stack.record("eng-refused").model_id != "other@1" and router.engines() == 1
    assert proc.output().count("REFUSED THIS ENGINE") == 1  # loud, but at most once per 30 s
    assert "would never share cache hits" in proc.output()


def test_sigterm_deregisters_drains_and_exits(stack):
    router = stack.router()
    proc = stack.engine("eng-term")
    body = {"prompt": "Once upon a time", "max_tokens": 300, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", proc.url + "/v1/completions", json=body, timeout=60) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")
        proc.popen.send_signal(signal.SIGTERM)
        until(lambda: httpx.get(proc.url + "/ready").status_code == 503, what="not ready")
        refused = httpx.post(proc.url + "/v1/completions", json={"prompt": "x"}, timeout=10)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        # the router dropped it at once, on its Deregister (not after missed heartbeats)
        until(lambda: stack.record("eng-term") is None, what="deregistered")
        assert router.metric("ragserve_router_engines_dropped_total", reason="deregister") == 1
        assert router.metric("ragserve_router_engines_dropped_total", reason="heartbeat_timeout") == 0
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"  # the running request finished
    assert proc.popen.wait(30) == 0
    assert router.engines() == 0


def test_mutual_tls_registration(stack, tmp_path):
    pki = write_test_pki(tmp_path)
    router = stack.router("--tls-cert", str(pki["server_cert"]), "--tls-key", str(pki["server_key"]),
                          "--tls-client-ca", str(pki["ca"]))  # fmt: skip
    tls = ["--router-tls-ca", str(pki["ca"]), "--router-tls-cert", str(pki["client_cert"])]
    proc = stack.engine("eng-tls", *tls, "--router-tls-key", str(pki["client_key"]))
    complete(proc.url, prompt_ids(9))
    want = expected_index(stack.record("eng-tls").model_id, [prompt_ids(9)])
    until(lambda: stack.index("eng-tls") == want, what="KV events over mutual TLS")
    assert router.engines() == 1
