"""The gRPC registry of a real router process, driven by a real gRPC client."""

from __future__ import annotations

import hashlib
import sys

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ragserve.v1 import registry_pb2, registry_pb2_grpc
from tests.helpers.net import free_port
from tests.helpers.pki import client_credentials, write_test_pki
from tests.helpers.process import start, wait_grpc

HEARTBEAT_MS = 300


@pytest.fixture(scope="module")
def router(module_cluster):
    return module_cluster.router("--heartbeat-interval-ms", str(HEARTBEAT_MS))


@pytest.fixture(scope="module")
def stub(router):
    channel = grpc.insecure_channel(router.grpc)
    yield registry_pb2_grpc.RegistryStub(channel)
    channel.close()


def models(router) -> list[str]:
    return [m["id"] for m in httpx.get(router.url + "/v1/models").json()["data"]]


def refused(stub, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        stub.Register(request)
    return info.value


def test_register_accepts_a_matching_engine(router, stub, make_register, metrics, until):
    resp = stub.Register(make_register("ok-1", model="m-ok"))
    assert resp.resume_from_seq == 0 and resp.heartbeat_interval_ms == HEARTBEAT_MS and resp.router_id
    assert "m-ok" in models(router)
    assert metrics(router.url, "ragserve_router_engines_registered", source="grpc") >= 1


def test_key_scheme_mismatch_is_refused_loudly(router, stub, make_register, metrics):
    before = metrics(router.url, "ragserve_router_registrations_refused_total", reason="key_scheme")
    err = refused(stub, make_register("old-1", model="m-old", key_scheme="ragserve-kv-v0"))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "key scheme 'ragserve-kv-v0'" in err.details() and "ragserve-kv-v1" in err.details()
    assert metrics(router.url, "ragserve_router_registrations_refused_total", reason="key_scheme") == before + 1
    assert "m-old" not in models(router)
    assert "registration refused (key_scheme)" in router.output()


@pytest.mark.parametrize(
    ("override", "reason", "needle"),
    [
        ({"block_size": 0}, "block_size", "block_size 0"),
        ({"tokenizer_fingerprint": "deadbeef"}, "tokenizer_fingerprint", "tokenizer fingerprint 'deadbeef'"),
        ({"probe_block_hashes": [hashlib.sha256(b"x").digest()]}, "probe_hashes", "probe block hashes differ"),
        ({"tokenizer_json": b"{not json"}, "tokenizer", "cannot load the shipped tokenizer"),
    ],
)
def test_incompatible_engines_are_refused(router, stub, make_register, metrics, override, reason, needle):
    before = metrics(router.url, "ragserve_router_registrations_refused_total", reason=reason)
    err = refused(stub, make_register(f"bad-{reason}", model=f"m-{reason}", **override))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert needle in err.details()
    assert metrics(router.url, "ragserve_router_registrations_refused_total", reason=reason) == before + 1


def test_engine_that_tokenizes_differently_is_refused(stub, make_register, prompt_tokenizer):
    from ragserve.keys import PROBE_MESSAGES, block_hashes, root_hash

    # a classic bug: the engine adds BOS again on top of the rendered chat template
    tokens = [1, *prompt_tokenizer.encode_chat(PROBE_MESSAGES)]
    req = make_register("probe-1", model="m-probe", probe_block_hashes=block_hashes(tokens, 16, root_hash("tiny@test")))
    err = refused(stub, req)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "probe block hashes differ from the router's from block 0" in err.details()


def test_same_model_name_with_other_weights_is_refused(router, stub, make_register):
    stub.Register(make_register("conf-a", model="m-conf", model_id="weights-a"))
    err = refused(stub, make_register("conf-b", model="m-conf", model_id="weights-b"))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "conf-a" in err.details() and "never share" in err.details()
    err = refused(stub, make_register("conf-c", model="m-conf", model_id="weights-a", block_size=32))
    assert "block_size" in err.details() or "(model_id, block_size" in err.details()
    stub.Deregister(registry_pb2.DeregisterRequest(engine_id="conf-a", reason="test"))
    stub.Register(make_register("conf-b", model="m-conf", model_id="weights-b"))  # no live conflict any more


def test_malformed_identity_is_invalid_argument(stub, make_register):
    err = refused(stub, make_register("", model="m-invalid"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "engine_id is required" in err.details()
    err = refused(stub, make_register("x", model="m-invalid", url="ftp://host"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_heartbeat_of_unknown_engine_asks_to_register(stub):
    assert not stub.Heartbeat(registry_pb2.HeartbeatRequest(engine_id="never-registered")).known


def _stored(seq: int, *hashes: bytes) -> registry_pb2.KVEvent:
    return registry_pb2.KVEvent(seq=seq, stored=registry_pb2.BlocksStored(block_hashes=list(hashes)))


def test_kv_events_are_acked_in_order_with_gaps_and_duplicates(router, stub, make_register, metrics):
    stub.Register(make_register("ev-1", model="m-ev"))
    before = metrics(router.url, "ragserve_router_kv_events_total", kind="stored")
    a, b, c = (hashlib.sha256(bytes([i])).digest() for i in range(3))
    batches = [
        [_stored(1, a), _stored(2, b)],
        [_stored(2, b)],  # duplicate: ignored
        [_stored(4, c)],  # gap (3 missing): ack stays at 2 so the engine resends
        [_stored(3, c), _stored(4, c)],
    ]
    acks = [
        ack.acked_seq
        for ack in stub.StreamKVEvents(
            iter(registry_pb2.KVEventBatch(engine_id="ev-1", events=events) for events in batches)
        )
    ]
    assert acks == [2, 2, 2, 4]
    assert metrics(router.url, "ragserve_router_kv_events_total", kind="stored") == before + 4
    # a reconnecting engine resumes after the last applied event
    assert stub.Register(make_register("ev-1", model="m-ev")).resume_from_seq == 4


def test_events_from_an_unregistered_engine_are_refused(stub):
    batch = registry_pb2.KVEventBatch(engine_id="stranger", events=[_stored(1, b"\0" * 32)])
    with pytest.raises(grpc.RpcError) as info:
        list(stub.StreamKVEvents(iter([batch])))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "Register first" in info.value.details()


def registered(stub, engine_id: str) -> bool:
    """Whether the registry still holds the engine (dropped: its event stream is refused), changing nothing."""
    try:
        list(stub.StreamKVEvents(iter([registry_pb2.KVEventBatch(engine_id=engine_id)])))
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
            return False
        raise
    return True


def test_missed_heartbeats_drop_the_engine(router, stub, make_register, metrics, until):
    dropped = metrics(router.url, "ragserve_router_engines_dropped_total", reason="heartbeat_timeout")
    stub.Register(make_register("hb-1", model="m-hb"))
    list(stub.StreamKVEvents(iter([registry_pb2.KVEventBatch(engine_id="hb-1", events=[_stored(1, b"\1" * 32)])])))
    assert stub.Heartbeat(registry_pb2.HeartbeatRequest(engine_id="hb-1")).known
    # dropped, not only expired: an expired engine leaves /v1/models at once, but until the sweep drops it a late
    # heartbeat still finds it (and the drop counter may have moved for another test's engine meanwhile)
    until(lambda: not registered(stub, "hb-1"), message="engine dropped after 3 missed heartbeats")
    assert "m-hb" not in models(router)
    assert metrics(router.url, "ragserve_router_engines_dropped_total", reason="heartbeat_timeout") > dropped
    assert not stub.Heartbeat(registry_pb2.HeartbeatRequest(engine_id="hb-1")).known
    assert stub.Register(make_register("hb-1", model="m-hb")).resume_from_seq == 0  # send a snapshot


def test_deregister_removes_the_engine_now(router, stub, make_register):
    stub.Register(make_register("dr-1", model="m-dr"))
    assert "m-dr" in models(router)
    stub.Deregister(registry_pb2.DeregisterRequest(engine_id="dr-1", reason="draining"))
    assert "m-dr" not in models(router)


def test_grpc_message_size_limit(cluster, make_register):
    small = cluster.router("--grpc-max-message-bytes", "1MiB")
    with grpc.insecure_channel(small.grpc) as channel, pytest.raises(grpc.RpcError) as info:
        registry_pb2_grpc.RegistryStub(channel).Register(make_register("big-1"))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_mutual_tls_registry(cluster, make_register, tmp_path):
    pki = write_test_pki(tmp_path)
    router = cluster.router(
        "--tls-cert", str(pki["server_cert"]), "--tls-key", str(pki["server_key"]), "--tls-client-ca", str(pki["ca"])
    )
    with grpc.secure_channel(router.grpc, client_credentials(pki, client="client")) as channel:
        assert registry_pb2_grpc.RegistryStub(channel).Register(make_register("tls-1")).heartbeat_interval_ms
    for creds in (client_credentials(pki), None):  # no client certificate; plaintext
        channel = grpc.secure_channel(router.grpc, creds) if creds else grpc.insecure_channel(router.grpc)
        with channel, pytest.raises(grpc.RpcError) as info:
            registry_pb2_grpc.RegistryStub(channel).Heartbeat(registry_pb2.HeartbeatRequest(engine_id="x"), timeout=5)
        assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


TOKEN = "registry-s3cret"
GOOD = (("authorization", f"Bearer {TOKEN}"),)


@pytest.fixture(scope="module")
def token_router(module_cluster, tmp_path_factory):
    path = tmp_path_factory.mktemp("registry") / "token"
    path.write_text(TOKEN + "\n")
    return module_cluster.router("--registry-token-file", str(path), "--heartbeat-interval-ms", str(HEARTBEAT_MS))


def calls(stub: registry_pb2_grpc.RegistryStub, make_register, metadata) -> dict:
    """Every registry RPC once, with this metadata: {name: status code}."""
    codes = {}
    rpcs = {
        "Register": lambda: stub.Register(make_register("tok-x", model="m-x"), metadata=metadata),
        "Heartbeat": lambda: stub.Heartbeat(registry_pb2.HeartbeatRequest(engine_id="tok-x"), metadata=metadata),
        "StreamKVEvents": lambda: list(stub.StreamKVEvents(iter([]), metadata=metadata)),
        "Deregister": lambda: stub.Deregister(registry_pb2.DeregisterRequest(engine_id="tok-x"), metadata=metadata),
    }
    for name, call in rpcs.items():
        try:
            call()
            codes[name] = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            codes[name] = exc.code()
    return codes


@pytest.mark.parametrize("metadata", [None, (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)])
def test_registry_token_refuses_missing_and_wrong_tokens_on_every_call(token_router, make_register, metadata):
    with grpc.insecure_channel(token_router.grpc) as channel:
        codes = calls(registry_pb2_grpc.RegistryStub(channel), make_register, metadata)
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert set(codes.values()) == {grpc.StatusCode.UNAUTHENTICATED}, codes
    assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes need no token
    assert "m-x" not in models(token_router)


def test_registry_token_admits_engines_that_send_it(token_router, make_register, until):
    with grpc.insecure_channel(token_router.grpc) as channel:
        stub = registry_pb2_grpc.RegistryStub(channel)
        assert stub.Register(make_register("tok-ok", model="m-tok"), metadata=GOOD).heartbeat_interval_ms
        assert stub.Heartbeat(registry_pb2.HeartbeatRequest(engine_id="tok-ok"), metadata=GOOD).known
        until(lambda: "m-tok" in models(token_router), message="engine listed")
        stub.Deregister(registry_pb2.DeregisterRequest(engine_id="tok-ok"), metadata=GOOD)


def test_a_router_without_token_or_mtls_refuses_registrations_unless_told(tmp_path, make_register):
    """Contract 3: no token file and no mTLS: every registration is refused, with the way out in the message."""
    for allow, expected in (((), grpc.StatusCode.UNAUTHENTICATED), (("--registry-allow-unauthenticated",), None)):
        http_port, grpc_port = free_port(), free_port()
        argv = [sys.executable, "-m", "ragserve.cli", "router", "--host", "127.0.0.1", "--port", str(http_port)]
        proc = start("router", [*argv, "--grpc-port", str(grpc_port), *allow], tmp_path / f"router-{grpc_port}.log")
        try:
            wait_grpc(f"127.0.0.1:{grpc_port}", proc=proc)
            with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
                stub = registry_pb2_grpc.RegistryStub(channel)
                if expected is None:
                    assert stub.Register(make_register("open-1")).heartbeat_interval_ms
                    continue
                error = refused(stub, make_register("closed-1"))
                assert error.code() == expected and "--registry-token-file" in error.details()
        finally:
            proc.stop()
