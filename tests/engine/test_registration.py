"""Registration, heartbeats and KV events against a real gRPC server (a recording servicer in the test)."""

from __future__ import annotations

import json
import signal

import httpx
import pytest

from ragserve import __version__
from ragserve.keys import KEY_SCHEME, probe_hashes
from ragserve.model_source import model_fingerprint, resolve_model
from ragserve.tls import server_credentials
from ragserve.tokenizer import PromptTokenizer
from ragserve.v1 import registry_pb2
from tests.helpers.engine_server import MODEL_NAME, metric, scrape, start_engine
from tests.helpers.net import free_port
from tests.helpers.pki import write_test_pki
from tests.helpers.process import until
from tests.helpers.registration import (
    Recorder,
    complete,
    expected_index,
    prompt_ids,
    serve_recorder,
)
from tests.helpers.tiny_models import tiny_model


@pytest.fixture
def cluster(tmp_path):
    """start(engine_id, *args) -> engine registered with a recorder on a fixed port; everything stopped after."""
    port = free_port()
    servers, engines = [], []

    def recorder(rec: Recorder | None = None, credentials=None) -> Recorder:
        server, rec = serve_recorder(port, rec, credentials)
        servers.append(server)
        return rec

    def engine(engine_id: str, *args: str):
        proc = start_engine(tmp_path, "--num-gpu-blocks", "256", "--router", f"127.0.0.1:{port}",
                            "--engine-id", engine_id, *args)  # fmt: skip
        engines.append(proc)
        proc.wait_ready()
        return proc

    def stop_recorder() -> None:
        servers[-1].stop(grace=None).wait()

    yield recorder, engine, stop_recorder
    for proc in engines:
        proc.stop(signal.SIGKILL)
    for server in servers:
        server.stop(grace=None)


def registered(rec: Recorder, n: int = 1) -> bool:
    with rec.lock:
        return len(rec.registers) >= n and bool(rec.known)


def index_of(rec: Recorder, engine_id: str) -> set[bytes]:
    with rec.lock:
        return set(rec.index.get(engine_id, ()))


def test_register_request_carries_the_engine_identity(cluster):
    recorder, engine, _ = cluster
    rec = recorder()
    proc = engine("eng-id", "--advertise-url", "http://10.1.2.3:8000/", "--cachestore", "127.0.0.1:1")
    until(lambda: registered(rec), what="registration")
    req = rec.registers[0]
    path = tiny_model("llama")
    model_id = model_fingerprint(resolve_model(str(path), MODEL_NAME))
    tok = PromptTokenizer.from_dir(path)
    ident = req.identity
    assert (ident.engine_id, ident.url, ident.served_model_name) == ("eng-id", "http://10.1.2.3:8000", MODEL_NAME)
    assert (ident.model_id, ident.key_scheme, ident.block_size) == (model_id, KEY_SCHEME, 16)
    assert ident.tokenizer_fingerprint == tok.fingerprint() and ident.version == __version__
    assert len(ident.layout_fingerprint) == 32
    assert ident.cachestore == "127.0.0.1:1"  # identity; heartbeats' Load no longer carries it
    assert "cachestore" not in registry_pb2.Load.DESCRIPTOR.fields_by_name
    assert req.tokenizer_json == tok.tokenizer_json.encode() and req.chat_template == tok.chat_template
    assert json.loads(req.special_tokens_json) == tok.special_tokens
    assert (req.num_blocks, req.max_model_len) == (256, 4096)
    assert list(req.probe_block_hashes) == probe_hashes(tok, 16, model_id) and len(req.probe_block_hashes) > 2
    assert httpx.get(proc.url + "/ready").json()["registered"] is True


def test_heartbeats_report_load_and_events_build_the_index(cluster):
    recorder, engine, _ = cluster
    rec = recorder()
    proc = engine("eng-hb")
    until(lambda: len(rec.heartbeats) >= 2, what="heartbeats")
    hb = rec.heartbeats[-1]
    assert hb.engine_id == "eng-hb" and hb.load.total_blocks == 256 and hb.load.free_blocks == 256
    prompts = [prompt_ids(k) for k in range(3)]
    for ids in prompts:
        complete(proc.url, ids)
    model_id = rec.registers[0].identity.model_id
    want = expected_index(model_id, prompts)
    until(lambda: index_of(rec, "eng-hb") == want, what="index equal to the engine's cached blocks")
    seqs = [ev.seq for ev in rec.events]
    assert seqs == list(range(1, len(seqs) + 1))
    assert rec.events[0].WhichOneof("event") == "cleared"  # first contact: a (here empty) snapshot
    chained = [ev.stored for ev in rec.events if ev.WhichOneof("event") == "stored" and ev.stored.parent_hash]
    assert chained == []  # each prompt's blocks start at the chain root ...
    stored = [ev.stored for ev in rec.events if ev.WhichOneof("event") == "stored"]
    assert [len(s.block_hashes) for s in stored] == [5, 5, 5]  # ... and arrive as one chain event each
    until(lambda: rec.heartbeats[-1].last_event_seq == seqs[-1], what="heartbeat carrying the last seq")


def test_first_heartbeat_carries_start_up_measurements_and_no_calibration_trace(cluster):
    """The engine calibrates before it reports ready: measured prefill rate from the first heartbeat on, the
    per-step prefill cap, and nothing of the synthetic requests in the KV index, counters or request metrics."""
    recorder, engine, _ = cluster
    rec = recorder()
    proc = engine("eng-cal", "--long-prefill-token-threshold", "64")
    until(lambda: rec.heartbeats and rec.events, what="first heartbeat and first-contact snapshot")
    load = rec.heartbeats[0].load
    assert load.prefill_tokens_per_s > 0 and load.long_prefill_token_threshold == 64
    assert (load.computed_prompt_tokens, load.queued_prefill_tokens, load.free_blocks) == (0, 0, 256)
    assert [ev.WhichOneof("event") for ev in rec.events] == ["cleared"]  # an empty snapshot: no salted blocks
    samples = scrape(proc.url)
    assert metric(samples, "ragserve:prefill_tokens_per_second") > 0
    assert metric(samples, "vllm:prefix_cache_queries_total") == 0
    assert not any(k.startswith(("vllm:request_success_total", "vllm:prompt_tokens_total")) and v
                   for k, v in samples.items())  # fmt: skip


@pytest.mark.parametrize("router_kept_state", [False, True], ids=["router-lost-state", "router-kept-state"])
def test_reconnect_resyncs_the_index(cluster, router_kept_state):
    recorder, engine, stop_recorder = cluster
    rec = recorder()
    proc = engine("eng-rc")
    complete(proc.url, prompt_ids(0))
    model_id = rec.registers[0].identity.model_id
    until(lambda: index_of(rec, "eng-rc") == expected_index(model_id, [prompt_ids(0)]), what="first events")
    stop_recorder()
    complete(proc.url, prompt_ids(1))  # the engine keeps serving while the router is away
    complete(proc.url, prompt_ids(2))
    kept = Recorder(rec.last_seq, rec.index) if router_kept_state else None
    rec2 = recorder(kept)
    until(lambda: registered(rec2), timeout=60, what="re-registration after the router came back")
    want = expected_index(model_id, [prompt_ids(k) for k in range(3)])
    until(lambda: index_of(rec2, "eng-rc") == want, what="index resynced after reconnect")
    if router_kept_state:  # replay: the events missed while away, numbered on from the old stream
        assert rec2.stream_starts[0] == rec.last_seq["eng-rc"] + 1
        assert all(ev.WhichOneof("event") == "stored" for ev in rec2.events)
    else:  # snapshot: cleared + every cached hash, numbered from 1
        assert rec2.stream_starts[0] == 1 and rec2.events[0].WhichOneof("event") == "cleared"
    assert proc.alive()


def test_unknown_engine_registers_again(cluster):
    recorder, engine, _ = cluster
    rec = recorder()
    proc = engine("eng-fg")
    complete(proc.url, prompt_ids(5))
    model_id = rec.registers[0].identity.model_id
    want = expected_index(model_id, [prompt_ids(5)])
    until(lambda: index_of(rec, "eng-fg") == want, what="events")
    rec.forget("eng-fg")
    until(lambda: registered(rec, 2), what="re-registration after known=false")
    until(lambda: index_of(rec, "eng-fg") == want, what="snapshot after the router forgot the engine")


def test_refused_engine_keeps_serving_and_retries(cluster):
    recorder, engine, _ = cluster
    rec = recorder()
    rec.refuse = 3
    proc = engine("eng-refused")
    assert complete(proc.url, prompt_ids(7))["usage"]["completion_tokens"] == 1
    until(lambda: registered(rec, 4), timeout=60, what="registration after three refusals")
    assert proc.output().count("REFUSED THIS ENGINE") == 1  # loud, but at most once per 30 s
    assert "test refusal" in proc.output()


def test_sigterm_deregisters_drains_and_exits(cluster):
    recorder, engine, _ = cluster
    rec = recorder()
    proc = engine("eng-term")
    until(lambda: registered(rec), what="registration")
    body = {"prompt": "Once upon a time", "max_tokens": 300, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", proc.url + "/v1/completions", json=body, timeout=60) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")
        proc.popen.send_signal(signal.SIGTERM)
        until(lambda: httpx.get(proc.url + "/ready").status_code == 503, what="not ready")
        refused = httpx.post(proc.url + "/v1/completions", json={"prompt": "x"}, timeout=10)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        until(lambda: rec.deregisters, what="deregister")
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"  # the running request finished
    assert rec.deregisters[0].engine_id == "eng-term" and rec.deregisters[0].reason == "SIGTERM"
    assert proc.popen.wait(30) == 0


def test_mutual_tls_registration(cluster, tmp_path):
    recorder, engine, _ = cluster
    pki = write_test_pki(tmp_path)
    credentials = server_credentials(str(pki["server_cert"]), str(pki["server_key"]), client_ca=str(pki["ca"]))
    rec = recorder(credentials=credentials)
    tls = ["--router-tls-ca", str(pki["ca"]), "--router-tls-cert", str(pki["client_cert"])]
    proc = engine("eng-tls", *tls, "--router-tls-key", str(pki["client_key"]))
    until(lambda: registered(rec), what="registration over mutual TLS")
    complete(proc.url, prompt_ids(9))
    want = expected_index(rec.registers[0].identity.model_id, [prompt_ids(9)])
    until(lambda: index_of(rec, "eng-tls") == want, what="KV events over mutual TLS")
