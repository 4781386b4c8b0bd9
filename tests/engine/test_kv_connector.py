"""Engine <-> cachestore: engine B fetches the blocks engine A computed instead of recomputing them;
a stalled store never stalls the step loop."""

from __future__ import annotations

import dataclasses
import signal
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import grpc
import pytest

from ragserve.v1 import cachestore_pb2 as pb
from ragserve.v1 import cachestore_pb2_grpc as pb_grpc
from ragserve_engine.kv_connector import PendingFetch
from ragserve_engine.llm import LLM
from ragserve_engine.sampling_params import SamplingParams
from ragserve_engine.sequence import Status
from tests.helpers.cachestore import CacheStoreProcess
from tests.helpers.net import free_port
from tests.helpers.pki import client_credentials, write_test_pki
from tests.helpers.tiny_models import tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
CONTEXT = list(range(5000, 5000 + 16 * 20))  # 20 full blocks of "retrieved document"


@pytest.fixture
def cachestore(tmp_path):
    store = CacheStoreProcess(tmp_path / "cachestore.log", free_port(), "--memory", "256MiB").wait_serving()
    yield store.address, store
    store.stop()


def eager(num_gpu_blocks: int = 128, **kwargs) -> LLM:
    """Eager: what varies here is where the KV comes from (compiled decode has its own tests)."""
    return LLM(str(tiny_model("llama")), enforce_eager=True, num_gpu_blocks=num_gpu_blocks, **kwargs)


def engine(address: str, **kwargs) -> LLM:
    return eager(cachestore=address, **kwargs)


def test_peer_fetch_replaces_prefill_and_output_matches_cold_run(cachestore):
    address, _ = cachestore
    a = engine(address)
    cold = a.generate([CONTEXT + [11, 12, 13]], GREEDY)[0]
    a.engine.connector.flush()
    assert a.engine.connector.stats.offloaded >= 20

    b = engine(address, loaded_model=a.engine.runner.model)
    question = CONTEXT + [21, 22, 23, 24]
    warm = b.generate([question], GREEDY)[0]
    assert b.engine.connector.stats.hits == 20 * 16  # every full context block was fetched
    assert warm.num_cached_tokens == 20 * 16  # so B prefilled only the question
    reference = eager(loaded_model=a.engine.runner.model)
    assert warm.outputs[0].token_ids == reference.generate([question], GREEDY)[0].outputs[0].token_ids
    # a second, identical question on A is a local hit, not a fetch
    again = a.generate([CONTEXT + [11, 12, 13]], GREEDY)[0]
    assert again.outputs[0].token_ids == cold.outputs[0].token_ids


def test_fetched_blocks_are_stored_with_their_tokens(cachestore):
    """The KV events of imported blocks carry the request's tokens, as computed ones do (vLLM's BlockStored)."""
    address, _ = cachestore
    a = engine(address)
    a.generate([CONTEXT + [11, 12, 13]], GREEDY)
    a.engine.connector.flush()
    b = engine(address, loaded_model=a.engine.runner.model)
    b.engine.pool.record_events = True
    assert b.generate([CONTEXT + [21, 22]], GREEDY)[0].num_cached_tokens == 20 * 16  # all fetched
    stored = {e.block_hashes[0]: e for e in b.engine.pool.take_events() if e.kind == "stored"}
    hashes = b.engine.kv_manager.hash_blocks(CONTEXT, None)
    assert [stored[h].token_ids for h in hashes] == [CONTEXT[i * 16 : (i + 1) * 16] for i in range(20)]


def test_other_layout_never_served(cachestore):
    address, _ = cachestore
    a = engine(address)
    a.generate([CONTEXT + [1]], GREEDY)
    a.engine.connector.flush()
    c = engine(address, block_size=32)
    c.generate([CONTEXT + [1]], GREEDY)
    assert c.engine.connector.stats.hits == 0


def test_cachestore_killed_mid_run_costs_only_misses(cachestore):
    address, store = cachestore
    a = engine(address)
    ref = eager(loaded_model=a.engine.runner.model)
    prompts = [CONTEXT + [i, i + 1] for i in range(3)]
    expected = [o.outputs[0].token_ids for o in ref.generate(prompts, GREEDY)]
    assert a.generate(prompts[:1], GREEDY)[0].outputs[0].token_ids == expected[0]
    store.stop(signal.SIGKILL)
    b = engine(address, loaded_model=a.engine.runner.model)
    outs = b.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert b.engine.connector.stats.hits == 0
    b.engine.connector.flush()  # offloads to the dead store are dropped, not raised


def test_engines_share_blocks_over_mutual_tls_with_a_token(tmp_path):
    certs = write_test_pki(tmp_path)
    token = tmp_path / "token"
    token.write_text("engine-shared-token\n")
    tls = ["--tls-cert", str(certs["server_cert"]), "--tls-key", str(certs["server_key"])]
    tls += ["--tls-client-ca", str(certs["ca"]), "--auth-token-file", str(token)]
    store = CacheStoreProcess(tmp_path / "cachestore.log", free_port(), "--memory", "64MiB", *tls)
    port = store.port
    try:
        store.wait_serving(client_credentials(certs, client="client"))
        secure = dict(cachestore_tls_ca=str(certs["ca"]), cachestore_tls_cert=str(certs["client_cert"]),
                      cachestore_tls_key=str(certs["client_key"]), cachestore_token_file=str(token))  # fmt: skip
        a = engine(f"localhost:{port}", **secure)
        a.generate([CONTEXT + [1]], GREEDY)
        a.engine.connector.flush()
        b = engine(f"localhost:{port}", loaded_model=a.engine.runner.model, **secure)
        b.generate([CONTEXT + [2]], GREEDY)
        assert b.engine.connector.stats.hits == 20 * 16
        plain = engine(f"localhost:{port}", loaded_model=a.engine.runner.model)  # no TLS: every lookup misses
        plain.generate([CONTEXT + [3]], GREEDY)
        assert plain.engine.connector.stats.hits == 0
    finally:
        store.stop()


class StallingStore(pb_grpc.CacheStoreServicer):
    """A real gRPC cachestore that stalls STALL_S on every call, then claims to hold every block it is asked
    about but sends none (the stall is the fault under test; a real store cannot be made to stall on cue)."""

    STALL_S = 2.0

    def __init__(self) -> None:
        self.calls = 0
        self.release = threading.Event()  # set at teardown: stalled calls end at once

    def _stall(self) -> None:
        self.calls += 1
        self.release.wait(self.STALL_S)

    def Lookup(self, request, context):
        self._stall()
        return pb.LookupResponse(prefix_len=len(request.keys))

    def Get(self, request, context):
        self._stall()
        return iter(())

    def Put(self, request_iterator, context):
        for _ in request_iterator:
            pass
        self._stall()
        return pb.PutResponse()


def serve(servicer: pb_grpc.CacheStoreServicer) -> tuple[str, grpc.Server]:
    """A real gRPC server for a fault-injecting servicer, on a free loopback port: (address, server)."""
    server = grpc.server(ThreadPoolExecutor(8))
    pb_grpc.add_CacheStoreServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return f"127.0.0.1:{port}", server


@pytest.fixture
def stalling_store():
    servicer = StallingStore()
    address, server = serve(servicer)
    yield address, servicer
    servicer.release.set()
    server.stop(grace=None)


def test_a_stalled_cachestore_never_stalls_other_requests(stalling_store):
    """A request whose fetch stalls waits in WAITING_FOR_REMOTE_KVS while a decoding request keeps getting a
    token every step; past the fetch deadline it recomputes, with the tokens of a run without a store."""
    address, store = stalling_store
    llm = engine(address)
    eng = llm.engine
    reference = eager(loaded_model=eng.runner.model)
    prompt = CONTEXT + [31, 32, 33]
    expected = reference.generate([prompt], GREEDY)[0].outputs[0].token_ids
    bystander = eng.add_request(
        "bystander", [7, 8, 9], SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    )
    while not bystander.seqs[0].output_token_ids:
        eng.step()
    stalled = eng.add_request("stalled", prompt, GREEDY)
    steps_waiting, tokens_while_waiting, outputs = 0, 0, {}
    while eng.has_unfinished_requests():
        waiting = stalled.status == Status.WAITING_FOR_REMOTE_KVS
        before = len(bystander.seqs[0].output_token_ids)
        for out in eng.step():
            outputs[out.request_id] = out
        if waiting:
            steps_waiting += 1
            tokens_while_waiting += len(bystander.seqs[0].output_token_ids) - before
    assert store.calls >= 1
    # the bystander kept its pace: a token for every step it ran while the other waited (it may finish first)
    assert tokens_while_waiting >= min(steps_waiting, 10) and tokens_while_waiting >= 10, (
        steps_waiting,
        tokens_while_waiting,
    )
    assert outputs["stalled"].outputs[0].token_ids == expected
    assert outputs["stalled"].num_cached_tokens == 0  # nothing came from the store: it recomputed
    assert eng.connector.stats.abandoned == 1 and eng.connector.stats.hits == 0
    assert eng.stats().cachestore_fetches_abandoned == 1  # /metrics: ragserve:cachestore_fetches_abandoned_total
    assert len(outputs["bystander"].outputs[0].token_ids) == 400
    # it took at least the 1 s deadline for 20 blocks: the fetch cost the router sees, and the next deadline for
    # as many blocks (3x their cost), learn that instead of counting only fetches fast enough to finish
    assert eng.connector.stats.fetch_s_per_block >= 1.0 / 20
    assert eng.connector.deadline_s(20) >= 3.0


def test_a_block_that_does_not_fit_ends_the_fetched_chain(cachestore):
    """A wrong-size block mid-chain (a fault the store's own checks never let through) must not shift the
    blocks after it onto the wrong hashes: only the blocks before it are imported."""
    address, _ = cachestore
    a = engine(address)
    a.generate([CONTEXT + [11, 12, 13]], GREEDY)
    a.engine.connector.flush()
    b = engine(address, loaded_model=a.engine.runner.model)
    conn = b.engine.connector
    hashes = b.engine.kv_manager.hash_blocks(CONTEXT, None)
    blocks = conn.client.get(hashes[:4])
    assert len(blocks) == 4
    blocks[2] = dataclasses.replace(blocks[2], data=blocks[2].data[:-1])
    done: Future = Future()
    done.set_result((blocks, 0.01))
    assert conn.finish_fetch(PendingFetch(hashes, 0, done, deadline=0.0)) == 2
    cached = [b.engine.kv_manager.pool.get_cached_block(h) is not None for h in hashes[:4]]
    assert cached == [True, True, False, False]


def test_a_fetch_cut_at_its_deadline_and_then_aborted_counts_once(cachestore):
    """A fetch past its deadline is cut when it settles (abandoned: counted, its cost learned); if the request
    is then aborted while it waits for room, the scheduler abandons it again: still one abandoned fetch."""
    address, _ = cachestore
    conn = engine(address).engine.connector
    pending = PendingFetch([bytes(32)] * 4, 0, Future(), deadline=0.0)  # a download that never finishes
    assert conn.settle(pending) == []
    cost = conn.stats.fetch_s_per_block
    conn.abandon(pending)  # Scheduler.finish on the abort
    assert conn.stats.abandoned == 1 and conn.stats.fetch_s_per_block == cost


class StallAfterFirstGet(pb_grpc.CacheStoreServicer):
    """A proxy to a real cachestore whose second and later Get calls stall (the fault under test: a store
    that slows down mid-transfer); everything else is the real store's answer."""

    def __init__(self, address: str) -> None:
        self.stub = pb_grpc.CacheStoreStub(grpc.insecure_channel(address))
        self.gets = 0
        self.release = threading.Event()

    def Lookup(self, request, context):
        return self.stub.Lookup(request)

    def Get(self, request, context):
        self.gets += 1
        if self.gets > 1:
            self.release.wait(30)
            return iter(())
        return self.stub.Get(request)


def test_a_fetch_cut_at_its_deadline_keeps_the_prefix_that_arrived(cachestore):
    """20 blocks in the store, fetched 16 per Get: the first Get arrives, the second stalls. At the deadline
    the request keeps the 16 blocks and recomputes only the rest, with the tokens of a cold run."""
    address, _ = cachestore
    a = engine(address)
    prompt = CONTEXT + [41, 42, 43]
    expected = a.generate([prompt], GREEDY)[0].outputs[0].token_ids
    a.engine.connector.flush()
    proxy = StallAfterFirstGet(address)
    proxy_address, server = serve(proxy)
    try:
        b = engine(proxy_address, loaded_model=a.engine.runner.model)
        b.engine.connector.fetch_deadline_s = 5.0  # room for the first chunk on a loaded host; the second never comes
        b.engine.connector.client.timeout_s = 60.0  # the stalled Get outlives the deadline (the fault under test)
        out = b.generate([prompt], GREEDY)[0]
        assert proxy.gets == 2
        assert out.outputs[0].token_ids == expected
        assert out.num_cached_tokens == 16 * 16  # the first chunk; the 4 stalled blocks were recomputed
        stats = b.engine.connector.stats
        assert stats.hits == 16 * 16 and stats.abandoned == 1
    finally:
        proxy.release.set()
        server.stop(grace=None)


def test_a_fetch_waits_about_as_long_as_recomputing_its_blocks(cachestore):
    """The deadline: waiting for a fetch longer than recomputing its blocks would take cannot pay; up to
    that long it may (ski rental: at most twice the better choice). The floor stays for an unmeasured engine."""
    address, _ = cachestore
    llm = engine(address)
    conn = llm.engine.connector
    assert conn.deadline_s(20) == conn.fetch_deadline_s  # nothing measured yet
    llm.generate([CONTEXT + [51]], GREEDY)  # a prefill: the engine's speed is measured
    speed = llm.engine.load.prefill_tokens_per_s
    assert speed > 0 and conn.prefill_tokens_per_s() == speed
    conn.prefill_tokens_per_s = lambda: 100.0  # a slow engine: 20 blocks of 16 tokens take 3.2 s to recompute
    assert conn.deadline_s(20) == pytest.approx(max(3.2, 3.0 * 20 * conn.stats.fetch_s_per_block))


def test_a_fetch_without_room_waits_for_running_requests_to_free_blocks(cachestore):
    """Fetched blocks that find the pool held by a running request wait for it to finish and then all land:
    importing what fits would make the request recompute the rest (and count them as not imported)."""
    address, _ = cachestore
    a = engine(address)
    question = CONTEXT + [61]
    reference = a.generate([question], GREEDY)[0]
    a.engine.connector.flush()
    b = engine(address, num_gpu_blocks=32, loaded_model=a.engine.runner.model)
    other = list(range(9000, 9000 + 16 * 12))  # 12 blocks the store does not hold, running for 32 steps
    long = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    running, warm = b.generate([other, question], [long, GREEDY])
    assert b.engine.kv_manager.num_importable_blocks() >= 20  # room came back when `other` finished
    assert warm.num_cached_tokens == 20 * 16
    assert b.engine.connector.stats.not_imported == 0
    assert warm.outputs[0].token_ids == reference.outputs[0].token_ids
    assert len(running.outputs[0].token_ids) == 32


def test_a_queued_request_fetches_back_the_prefix_evicted_while_it_waited(cachestore):
    """A request whose document was cached locally when it first reached the head of the queue, but could not
    be admitted, loses those blocks to a running request's growth; when it is admitted it fetches them back
    from the cachestore instead of recomputing them."""
    address, _ = cachestore
    b = engine(address, num_gpu_blocks=40)
    question = CONTEXT + [61]
    reference = b.generate([question], GREEDY)[0]  # CONTEXT's 20 blocks: cached here and offloaded
    b.engine.connector.flush()
    other = list(range(9000, 9000 + 16 * 20))  # running first: with it, the pool has no block for `question`
    engine_ = b.engine
    running = engine_.add_request("other", other, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    while running.status != Status.RUNNING:  # its own (empty) fetch may wait a step or two
        engine_.step()
    warm = engine_.add_request("question", question, GREEDY)
    finished = {}
    while engine_.has_unfinished_requests():  # `other` grows past 20 blocks: evicts the idle document
        finished.update((out.request_id, out) for out in engine_.step() if out.finished)
    assert warm.num_cached_tokens == 20 * 16
    assert engine_.connector.stats.hits > 0  # the evicted part came from the store
    assert finished["question"].outputs[0].token_ids == reference.outputs[0].token_ids
    assert len(finished["other"].outputs[0].token_ids) == 40


def test_fetched_blocks_without_a_free_kv_block_are_counted(cachestore):
    """An engine whose pool has fewer free blocks than a fetch brought imports what fits (the request
    recomputes the rest) and counts the others: ragserve:cachestore_blocks_not_imported on /metrics."""
    address, _ = cachestore
    a = engine(address)
    a.generate([CONTEXT + [61]], GREEDY)
    a.engine.connector.flush()
    b = engine(address, num_gpu_blocks=12, loaded_model=a.engine.runner.model)
    conn = b.engine.connector
    hashes = b.engine.kv_manager.hash_blocks(CONTEXT, None)
    blocks = conn.client.get(hashes)
    assert len(blocks) == 20
    room = b.engine.kv_manager.num_importable_blocks()
    assert 0 < room < 20
    done: Future = Future()
    done.set_result((blocks, 0.01))
    assert conn.finish_fetch(PendingFetch(hashes, 0, done, deadline=0.0)) == room
    assert conn.stats.not_imported == 20 - room
    assert b.engine.stats().cachestore_blocks_not_imported == 20 - room
    assert b.engine.stats().cachestore_offload_dropped == 0
